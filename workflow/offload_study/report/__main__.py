from offload_study.report.render import main

raise SystemExit(main())
