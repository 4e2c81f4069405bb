from frontend.cli import main

main()
