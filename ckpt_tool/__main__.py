from ckpt_tool.cli.entry import main

raise SystemExit(main())
