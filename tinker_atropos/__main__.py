from tinker_atropos.launcher.cli import main

main()
