"""`python -m lorafaas` is the `lorafaas` command."""

from lorafaas.platform.cli import main

main()
