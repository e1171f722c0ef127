"""`python -m lorafaas` is the `lorafaas` command."""

from lorafaas.cli import main

main()
