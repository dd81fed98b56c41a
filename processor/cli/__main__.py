from processor.cli.commands import main

main()
