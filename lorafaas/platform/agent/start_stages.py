"""The stages of deployments' registrations and of the instance starts on this node, every function's together: a
bounded series per stage for `/metrics` (`lorafaas_instance_start_seconds{stage}`: sum and count), whatever the
number of functions. Each start's own breakdown is in its instance's record (`describe`: `cold_start`), its
function's `last_cold_start` and `registration`."""

from __future__ import annotations

# prepare: its worker spec (daemon socket, LoRA mode, sizes); spawn: until the process listens (a fork from the
# zygote, or a pool process given the function); standby_warm: a pool process's backbone attach and warm-up, done
# before (off the start); libraries, backbone, adapter, warmup: the stages it ran; total: from the start's beginning
# to ready; first_token: its first request's first token from dispatch; first_prefill: that request's forward pass.
# A deployment's registration before it (service.deploy): register_check, _adapter, _state, _apply.
STAGES = ("register_check", "register_adapter", "register_state", "register_apply", "prepare", "spawn", "standby_warm",
          "libraries", "backbone", "adapter", "warmup", "total", "first_prefill", "first_token")


class StartStages:
    def __init__(self) -> None:
        self._count: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._sum_s: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def observe(self, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            if stage in self._count:  # only the known stages: the series stay bounded
                self._count[stage] += 1
                self._sum_s[stage] += seconds

    def snapshot(self) -> dict[str, tuple[int, float]]:
        """stage -> (starts that had it, their seconds summed); stages never seen are left out."""
        return {stage: (count, self._sum_s[stage]) for stage, count in list(self._count.items()) if count}
