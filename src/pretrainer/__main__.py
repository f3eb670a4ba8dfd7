from pretrainer.cli.main import main

raise SystemExit(main())
