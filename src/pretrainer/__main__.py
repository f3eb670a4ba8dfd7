from pretrainer.cli import main

raise SystemExit(main())
