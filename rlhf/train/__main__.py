"""`python -m rlhf.train`: the in-process driver's command line (`rlhf.train.cli`)."""

from rlhf.train.cli import main

main()
