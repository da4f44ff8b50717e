"""Maps patches/ and verify/ into the ddtree_patcher namespace (see pyproject.toml)."""

from setuptools import find_packages, setup

DIRS = {"ddtree_patcher": "ddtree_patcher", "ddtree_patcher.patches": "patches",
        "ddtree_patcher.verify": "verify"}
packages = []
for pkg, folder in DIRS.items():
    packages.append(pkg)
    packages += [f"{pkg}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=DIRS,
    package_data={pkg: ["*.json", "*.txt", "payload/*.py", "payload/**/*.py"] for pkg in packages},
    include_package_data=False,
)
