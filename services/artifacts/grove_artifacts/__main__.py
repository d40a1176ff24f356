from grove_artifacts.service import main

main()
