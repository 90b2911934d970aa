from tableserver.cli import main

raise SystemExit(main())
