"""Which isolation a sandbox gives, and how that is said: the refusal of `auto` and `strict`
where bubblewrap cannot run, the warning of `rlimits`, and the one line that a run's log and
`megagrpo report` show.

    auto, strict  bubblewrap (namespaces, seccomp, cgroups where they can be made), or refuse
    rlimits       rlimits only, chosen knowingly: no isolation of the file system or network
"""
from __future__ import annotations

MODES = ("auto", "strict", "rlimits")
# what a sandbox has; the code reward logs each as rewards/<fn>/sandbox/<feature> (1 or 0)
FEATURES = ("bubblewrap", "seccomp", "cgroups")


def refusal(setting: str, mode: str, problem: str) -> str:
    """Why `mode` does not start without bubblewrap, and the two ways out."""
    return (f"{setting}: {mode}, but bubblewrap cannot run here ({problem}); model-written code runs only "
            "under bubblewrap unless told otherwise. Either install bubblewrap and allow unprivileged user "
            "namespaces (launch/install_system.sh installs it; `bwrap --unshare-all --ro-bind / / true` must "
            f"then succeed), or set {setting}: rlimits to accept rlimits only, knowing that the code can then "
            "read the host's files and reach its network (docs/sandbox.md, Modes)")


def rlimits_warning(setting: str) -> str:
    bar = "!" * 78
    return (f"\n{bar}\nmegagrpo sandbox: bubblewrap is not in use ({setting}: rlimits). Model-written code runs "
            "with rlimits only:\nit can read the file system and use the network. Install `bubblewrap` and set "
            f"{setting}: auto to isolate it.\n{bar}")


def describe(bubblewrap: float, seccomp: float, cgroups: float, chosen_by: str | None = None) -> str:
    """The sandbox in a few words, e.g. "bubblewrap (namespaces, seccomp, cgroups)", from the
    share (0 to 1) of the completions whose sandbox had each feature: 1 or 0 for one sandbox,
    a mean over a run's metrics in its report."""
    def share(value: float) -> str:
        return "" if value >= 1 else f" for {value:.0%} of the completions"

    if bubblewrap <= 0:
        return ("rlimits only (weaker: the code can read the host's files and reach its network"
                + (f"; chosen by {chosen_by}" if chosen_by else "") + ")")
    extras = (("seccomp", seccomp), ("cgroups", cgroups))
    having = ["namespaces"] + [name + share(value) for name, value in extras if value > 0]
    lacking = [f"no {name}" for name, value in extras if value <= 0]
    return f"bubblewrap{share(bubblewrap)} ({', '.join(having)}{'; ' if lacking else ''}{', '.join(lacking)})"
