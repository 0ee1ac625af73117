"""pagecast."""

# The kernel ABI: the version of the calls the builder's rendered model.py makes into
# pagecast.kernels (names, argument order, meaning). enginebuild records it in the manifest and
# the runtime refuses an artifact built for another one. Bump it in the same change that alters
# such a call (a template in templates/ or a kernel's signature), so old artifacts are refused
# with a rebuild command instead of calling the new kernels with old arguments.
KERNEL_ABI = 1
