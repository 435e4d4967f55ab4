"""`python -m exactspec.kernels`: build the kernels for this CPU (see build.py); `--check` then
times a step on every instruction-set path (exactspec.bench.isa_paths)."""

from exactspec.kernels.build import main

raise SystemExit(main())
