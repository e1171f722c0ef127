"""`helm install|upgrade|uninstall` through the repository's Helm library (helm-python-sdk, Helm 4 in-process), for
machines without a `helm` binary: `scripts/k8s-testenv.sh start` puts a `helm` running this on the PATH it prints, so
docs/kubernetes.md's commands run as written. Only what those commands use: `-f/--values` (merged in order),
`--set key.path=value` (values typed as YAML), `-n/--namespace`; the cluster is $KUBECONFIG's.

    python -m tests.support.helm_cli install lorafaas manifests/charts/lorafaas -f my-values.yaml --set device=cpu
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml


def merge(into: dict, values: dict) -> dict:
    """Helm's merge of values files: maps merge key by key, anything else is replaced."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def set_value(values: dict, assignment: str) -> None:
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise ValueError(f"--set {assignment!r}: expected key.path=value")
    *parents, last = path.split(".")
    node = values
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {assignment!r}: {key} is not a map")
    node[last] = yaml.safe_load(text) if text else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="helm", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--namespace", default="default")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("install", "upgrade"):
        one = sub.add_parser(command)
        one.add_argument("name")
        one.add_argument("chart", type=Path)
        one.add_argument("-f", "--values", action="append", default=[], type=Path)
        one.add_argument("--set", action="append", default=[], dest="assignments")
        one.add_argument("-n", "--namespace", dest="namespace_", default=None)
    uninstall = sub.add_parser("uninstall")
    uninstall.add_argument("name")
    uninstall.add_argument("-n", "--namespace", dest="namespace_", default=None)
    args = parser.parse_args(argv)
    namespace = args.namespace_ or args.namespace

    import helm_python as helm

    try:
        with helm.Config(kubeconfig_path=os.environ.get("KUBECONFIG"), namespace=namespace) as config:
            if args.command == "uninstall":
                config.uninstall(args.name)
                print(f'release "{args.name}" uninstalled')
                return 0
            values: dict = {}
            for path in args.values:
                merge(values, yaml.safe_load(path.read_text()) or {})
            for assignment in args.assignments:
                set_value(values, assignment)
            act = config.install if args.command == "install" else config.upgrade
            release = act(str(args.chart), args.name, values, namespace=namespace)
    except (helm.HelmError, OSError, ValueError, yaml.YAMLError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(f"NAME: {args.name}\nNAMESPACE: {namespace}\nSTATUS: {release.get('status')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
