from titan_exp.checkpoint.export import main

raise SystemExit(main())
