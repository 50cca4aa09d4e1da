"""Build pure-Python wheels of the two frozen packages this project needs.

* chainer 7.8.1 is sdist-only for modern Pythons and its ``setup.py`` imports
  ``pkg_resources``: it is built without build isolation, inside an
  environment that already has ``setuptools<70``, ``wheel`` and ``numpy``.
* chainercv 0.13.1 is sdist-only and its Cython-generated GPU-NMS helper
  (``chainercv/utils/bbox/_nms_gpu_post.c``) does not compile on Python
  >= 3.11.  It is built with no extension modules and our pure-Python module
  of the same name (``tools/chainercv_patch/_nms_gpu_post.py``).

Usage::

    python tools/build_frozen_wheels.py --wheel-dir build/wheels

Wheels already present in ``--wheel-dir`` are reused, so the script is
idempotent; ``--force`` rebuilds them.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = {'chainer': '7.8.1', 'chainercv': '0.13.1'}


def run(*args):
    print('+', ' '.join(args), flush=True)
    subprocess.check_call(args)


def pip(*args):
    run(sys.executable, '-m', 'pip', *args)


def existing_wheel(wheel_dir, name, version):
    found = glob.glob(os.path.join(
        wheel_dir, '{}-{}-*.whl'.format(name, version)))
    return found[0] if found else None


PATCHED = {'chainercv': ('chainercv/utils/bbox/_nms_gpu_post.py',
                         os.path.join(HERE, 'chainercv_patch',
                                      '_nms_gpu_post.py'))}


def is_stale(wheel, name):
    """Whether a wheel holds another version of our patched module."""
    if name not in PATCHED:
        return False
    member, source = PATCHED[name]
    with open(source, 'rb') as f:
        wanted = f.read()
    try:
        with zipfile.ZipFile(wheel) as z:
            return z.read(member) != wanted
    except (KeyError, zipfile.BadZipFile):
        return True


def download_sdist(name, version, sdist_dir):
    path = os.path.join(sdist_dir, '{}-{}.tar.gz'.format(name, version))
    if not os.path.exists(path):
        pip('download', '--no-deps', '--no-binary', ':all:',
            '--no-build-isolation', '-d', sdist_dir,
            '{}=={}'.format(name, version))
    return path


def patch_chainercv(src_dir):
    setup_py = os.path.join(src_dir, 'setup.py')
    with open(setup_py) as f:
        text = f.read()
    patched, n = re.subn(r'ext_modules\s*=\s*extensions', 'ext_modules=[]',
                         text)
    if n != 1:
        raise RuntimeError(
            'could not find ext_modules in {}; is this chainercv '
            '0.13.1?'.format(setup_py))
    with open(setup_py, 'w') as f:
        f.write(patched)
    bbox_dir = os.path.join(src_dir, 'chainercv', 'utils', 'bbox')
    c_file = os.path.join(bbox_dir, '_nms_gpu_post.c')
    if os.path.exists(c_file):
        os.remove(c_file)
    shutil.copy(os.path.join(HERE, 'chainercv_patch', '_nms_gpu_post.py'),
                bbox_dir)


def build(name, version, wheel_dir, sdist_dir):
    sdist = download_sdist(name, version, sdist_dir)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp)
        src_dir = os.path.join(tmp, '{}-{}'.format(name, version))
        if name == 'chainercv':
            patch_chainercv(src_dir)
        pip('wheel', '--no-deps', '--no-build-isolation', '-w', wheel_dir,
            src_dir)
    wheel = existing_wheel(wheel_dir, name, version)
    if wheel is None or not wheel.endswith('-py3-none-any.whl'):
        raise RuntimeError('expected a pure-Python wheel of {}, got {}'
                           .format(name, wheel))
    return wheel


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--wheel-dir', default='build/wheels')
    parser.add_argument('--sdist-dir', default='build/sdists')
    parser.add_argument('--force', action='store_true')
    args = parser.parse_args()
    os.makedirs(args.wheel_dir, exist_ok=True)
    os.makedirs(args.sdist_dir, exist_ok=True)
    for name, version in PACKAGES.items():
        wheel = existing_wheel(args.wheel_dir, name, version)
        if wheel and (args.force or is_stale(wheel, name)):
            os.remove(wheel)
            wheel = None
        if wheel is None:
            wheel = build(name, version, args.wheel_dir, args.sdist_dir)
        print('{} {}: {}'.format(name, version, wheel), flush=True)


if __name__ == '__main__':
    main()
