from rollout_proxy.cli import main

raise SystemExit(main())
