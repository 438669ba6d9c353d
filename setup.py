"""The package list (everything else is in pyproject.toml). The code installs under ``layertap``:
``layertap/producer`` and ``layertap/worker`` link to the top-level folders. For one release the
wheel also installs ``producer`` and ``worker`` as deprecated shims (``layertap/shims``) that alias
the old names (``layertap.legacy_names``)."""

from setuptools import find_namespace_packages, setup

code = find_namespace_packages(include=["layertap", "layertap.*"], exclude=["layertap.shims*", "*.__pycache__"])
setup(packages=[*code, "producer", "worker"],
      package_dir={"producer": "layertap/shims/producer", "worker": "layertap/shims/worker"})
