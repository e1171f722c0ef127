"""The chart's image references: each of the three images pinned by its own digest renders `repository:tag@digest`
(the CUDA variant's tag included), a valid reference, distinct per image; a digest in `image.tag` (one digest for
three builds) is refused naming the field."""

import re
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")

CHART = Path(__file__).resolve().parents[2] / "manifests" / "charts" / "lorafaas"
DIGESTS = {"gateway": "sha256:" + "1" * 64, "nodeAgent": "sha256:" + "2" * 64, "function": "sha256:" + "3" * 64}
REPOSITORIES = {"gateway": "lorafaas/gateway", "nodeAgent": "lorafaas/node-agent", "function": "lorafaas/function"}

# The reference grammar of the distribution project (github.com/distribution/reference, regexp.go), anchored:
# [domain/]path[:tag][@digest]
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?)"
REFERENCE = re.compile(rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
                       r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")


def render(values: dict | None) -> list[dict]:
    with helm.Chart.load(CHART) as loaded:
        rendered = loaded.render(values=values, name="lorafaas", namespace="lf", is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def images_by_component(objects: list[dict]) -> dict[str, set[str]]:
    """app.kubernetes.io/component -> the images of its containers (init containers included)."""
    pods = [(o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"]["spec"]) for o in objects
            if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]
    for o in objects:
        if o["kind"] == "ConfigMap" and "pod.yaml" in o.get("data", {}):
            pod = yaml.safe_load(o["data"]["pod.yaml"])
            pods.append((pod["metadata"]["labels"], pod["spec"]))
    images: dict[str, set[str]] = {}
    for labels, spec in pods:
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            images.setdefault(labels["app.kubernetes.io/component"], set()).add(container["image"])
    return images


@pytest.mark.parametrize(("variant", "registry"), [("cpu", ""), ("cuda", ""), ("cuda", "registry.example:5000/acme")])
def test_each_image_is_pinned_by_its_own_digest_as_a_valid_reference(variant: str, registry: str) -> None:
    image = {"variant": variant, "registry": registry, "tag": "0.1.0"}
    image |= {name: {"repository": REPOSITORIES[name], "digest": digest} for name, digest in DIGESTS.items()}
    values = {"image": image, **({"device": "cuda"} if variant == "cuda" else {})}
    images = images_by_component(render(values))
    tag = "0.1.0-cuda" if variant == "cuda" else "0.1.0"
    prefix = f"{registry}/" if registry else ""
    expected = {name: f"{prefix}{REPOSITORIES[name]}:{tag}@{DIGESTS[name]}" for name in DIGESTS}
    assert images["controller"] == {expected["gateway"]}
    assert images["node-agent"] == {expected["nodeAgent"]}  # the daemons and the init containers
    assert images["function"] == {expected["function"]}
    lorafaas = images["controller"] | images["node-agent"] | images["function"]
    assert len(lorafaas) == 3  # three builds, three digests
    for reference in lorafaas | images["redis"]:
        assert REFERENCE.match(reference), reference


def test_without_digests_the_references_are_tags_and_a_digest_in_the_tag_is_refused() -> None:
    images = images_by_component(render({"image": {"variant": "cuda"}, "device": "cuda"}))
    assert images["function"] == {"lorafaas/function:0.1.0-cuda"}
    assert REFERENCE.match("lorafaas/function:0.1.0@sha256:" + "1" * 64 + "-cuda") is None  # what the old pin made
    with pytest.raises(helm.HelmError, match="tag"):
        render({"image": {"tag": "0.1.0@sha256:" + "1" * 64}})
    with pytest.raises(helm.HelmError, match="digest"):
        render({"image": {"function": {"repository": "lorafaas/function", "digest": "1" * 64}}})
