from kdeq.cli import main

main()
