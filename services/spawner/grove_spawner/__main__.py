from grove_spawner.service import main

main()
