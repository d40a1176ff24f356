from grove_router.service import main

main()
