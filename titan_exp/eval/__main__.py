from titan_exp.eval.evaluator import main

raise SystemExit(main())
