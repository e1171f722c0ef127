"""Every benchmark, baseline and standalone comparison, run as `lorafaas bench NAME` (docs/performance.md gives each
one's method, current figure and command)."""
