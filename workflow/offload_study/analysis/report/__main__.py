from offload_study.analysis.report.render import main

raise SystemExit(main())
