"""Packaging glue: one ``mmspec`` namespace over the repository's top-level layout.

``pipelines/``, ``models/``, ``evaluation/`` and ``demos/`` stay top-level folders (the layout users asked
for) and are installed as ``mmspec.pipelines``, ``mmspec.models``, ``mmspec.evaluation`` and ``mmspec.demos``. Everything else is
declared in pyproject.toml.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "mmspec": "mmspec",
    "mmspec.pipelines": "pipelines",
    "mmspec.models": "models",
    "mmspec.evaluation": "evaluation",
    "mmspec.demos": "demos",
}


def _packages() -> list[str]:
    packages = []
    for package, folder in PACKAGE_DIRS.items():
        packages.append(package)
        packages += [f"{package}.{sub}" for sub in find_packages(folder)]
    return sorted(set(packages))


setup(
    packages=_packages(),
    package_dir=PACKAGE_DIRS,
    package_data={
        "mmspec": ["py.typed"],  # PEP 561: the package's type hints are for its users' type checkers too
        # every file a zoo folder holds (weights, configs, tokenizer and processor files, chat templates)
        "mmspec.models": ["zoo/**/*.json", "zoo/**/*.safetensors", "zoo/**/*.txt", "zoo/**/*.jinja"],
        "mmspec.evaluation": ["weights/*.safetensors"],
    },
    include_package_data=True,
    # the changelog travels with every install (the sdist takes it through MANIFEST.in)
    data_files=[("share/doc/mmspec", ["CHANGELOG.md"])],
)
