"""`python -m rlhf.train`: the in-process driver's command line."""

from rlhf.train import main

main()
