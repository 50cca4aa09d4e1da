"""gradient-scaling: per-tensor gradient scaling for mixed precision training.

Chainer/CuPy implementation of Zhao et al., "Reducing Underflow in Mixed
Precision Training by Gradient Scaling" (IJCAI 2020), with the S2FP8 format
(Cambier et al., ICLR 2020) as a second low-precision method.

chainer 7.8.1 and chainercv 0.13.1 are installed from wheels built by
``tools/build_frozen_wheels.py`` (``make setup`` does it): their sdists do not
build on current Pythons as they are.
"""

from setuptools import find_packages
from setuptools import setup

install_requires = [
    'chainer==7.8.1',
    'chainercv==0.13.1',
    # Python 3.11 is tested with NumPy 1.26, Python 3.12 with NumPy 2.
    'numpy>=1.24,<2; python_version < "3.12"',
    'numpy>=2; python_version >= "3.12"',
    'scipy>=1.10',
    'matplotlib>=3.7',
    'opencv-python-headless>=4.8,<4.12; python_version < "3.12"',
    'opencv-python-headless>=4.10; python_version >= "3.12"',
    'Pillow>=9',
]

extras_require = {
    'test': [
        'pytest>=7',
        # The formats' oracle. 0.7 rounds float32 subnormals to E8M0
        # otherwise than 0.5 (the casts follow 0.5): one oracle on every
        # Python, or the cast tests would test the version.
        'ml_dtypes>=0.5.4,<0.6',
        'scikit-learn>=1.3',
    ],
    'mpi': ['mpi4py>=3.1'],
    'gpu': ['cupy-cuda13x>=13'],
    # gradient_scaling.torch (imports without Chainer)
    # (ninja builds the adapter's native callbacks, gradient_scaling/torch/
    # native.cpp, on first use; without it the Python ones serve)
    'torch': ['torch>=2.4', 'ninja'],
    # The frameworks GradientScaler's drop-in tests run in
    # (tests/test_torch_frameworks.py); the Makefile's TORCH_FRAMEWORKS
    # installs these pins beside torch==2.13.0, which none of them replaces.
    'torch-frameworks': ['torch>=2.4', 'lightning==2.6.6',
                         'accelerate==1.16.0', 'transformers==5.24.0'],
}

setup(
    name='gradient-scaling',
    version='0.1.0',
    description='Gradient scaling for mixed precision training (Chainer)',
    long_description=__doc__,
    license='MIT',
    python_requires='>=3.9',
    # example_data: the examples' datasets (readers of a user's folders,
    # generated data); example_common: what the example scripts share
    # (examples/*/train*.py import both as packages, with no sys.path edit).
    packages=find_packages(include=['gradient_scaling', 'gradient_scaling.*',
                                    'chainer_links', 'chainer_links.*',
                                    'example_data', 'example_data.*',
                                    'example_common', 'example_common.*',
                                    'torch_models', 'torch_models.*']),
    # (the native callbacks' source, compiled on first use)
    package_data={'gradient_scaling.torch': ['native.cpp']},
    install_requires=install_requires,
    extras_require=extras_require,
)
