from grove_governor.service import main

main()
