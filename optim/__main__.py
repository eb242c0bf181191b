"""`python -m optim`: the versions, the platform, the devices and the fused kernel's status, for a bug report."""

from ._info import print_info

if __name__ == "__main__":
    print_info()
