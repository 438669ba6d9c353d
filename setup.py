"""The package list (everything else is in pyproject.toml). The code installs under ``layertap``:
``layertap/producer`` and ``layertap/worker`` link to the top-level folders. For one release the
wheel also installs ``producer`` and ``worker`` as deprecated shims (``layertap/shims``) that alias
the old names (``layertap.legacy_names``).

Beside the packages goes ``layertap-hs-connectors.pth``: Python runs it at start, and it registers
layertap's hs-connectors backend whenever a process imports ``hs_connectors``
(``layertap/shims/_layertap_hs_connectors``). ``build_py`` writes it where the install's top level
is: the wheel's build folder, or, for an editable install, the editable wheel's folder."""

from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

HOOK = "_layertap_hs_connectors"
PTH = "layertap-hs-connectors.pth"


class BuildWithHook(build_py):
    """``build_py`` that also writes :data:`PTH` at the install's top level (module doc)."""

    def run(self) -> None:
        super().run()
        top = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(top, PTH).write_text(f"import {HOOK}\n")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH))]


code = find_namespace_packages(include=["layertap", "layertap.*"], exclude=["layertap.shims*", "*.__pycache__"])
setup(packages=[*code, "producer", "worker", HOOK],
      package_dir={"producer": "layertap/shims/producer", "worker": "layertap/shims/worker",
                   HOOK: f"layertap/shims/{HOOK}"},
      cmdclass={"build_py": BuildWithHook})
