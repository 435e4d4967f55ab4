"""`python -m exactspec.kernels`: build the kernels for this CPU (see build.py)."""

from exactspec.kernels.build import main

main()
