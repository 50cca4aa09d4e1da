"""The example scripts: smoke runs of every scaling mode, data layouts, errors.

Each script is imported from its path and its ``main(argv)`` is called in
this process (much faster than a subprocess per run).  Runs use the embedded
data at tiny sizes; the ``slow`` tests train with the scripts' own defaults
and check that they learn.
"""

import gradient_scaling  # NOQA: compat must precede chainer

import gzip
import math
import os
import random
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
from PIL import Image
import pytest

from example_common.errors import DatasetError
from example_common import schedules
from example_data import FashionMNISTDataset
from example_data import ShapesDetectionDataset
from example_data import ShapesSegmentationDataset
from gradient_scaling.chainer import files
from gradient_scaling.core.recipes import MODES as SCALING_MODES

from helpers import EXAMPLES
from helpers import last
from helpers import load_example
from helpers import mpiexec_command
from helpers import read_log
from helpers import ROOT

# script, options for a two-iteration run with one evaluation, its metric.
SMOKE = {
    # SSD has no size option: its evaluation covers the 100 test images.
    'ssd': ('ssd/train.py', ['--batchsize', '2'], 'validation/main/map'),
    'segnet': ('segnet/train.py',
               ['--batchsize', '2', '--embedded-size', '4', '2'],
               'validation/main/miou'),
    # ResNet-18's trainer snapshots take seconds to write: one test
    # below covers them.
    'classification': ('classification/train_imagenet_multi.py',
                       ['--batchsize', '2', '--embedded-size', '8', '4',
                        '--snapshot-interval', '0'],
                       'validation/main/accuracy'),
    'cifar': ('cifar/train.py',
              ['--batchsize', '2', '--embedded-size', '8', '4'],
              'validation/main/accuracy'),
}


# What a smoke run prints, besides the progress bar: the start line (after
# the CPU note when the precision is simulated), the columns of the table
# between lr and the scaling values, those after them, and the label of
# the final line.
PRINTED = {
    'ssd': ('SSD (small) on embedded data: 500 train / 100 test images, '
            'scaling={scaling}, precision={precision}, batch 2, '
            '2 iterations',
            ['main/loss', 'main/loss/loc', 'main/loss/conf'],
            ['validation/main/map'], 'VOC07 mAP'),
    'segnet': ('SegNetBasic on embedded data: 4 train / 2 test images, '
               'scaling={scaling}, precision={precision}, batch 2, '
               '2 iterations',
               ['main/loss'],
               ['validation/main/miou', 'validation/main/pixel_accuracy'],
               'mIoU'),
    'classification': ('resnet18 on embedded data: 8 train / 4 val images, '
                       '1 process(es) x batch 2, lr 0.1, scaling={scaling}, '
                       'precision={precision}, 2 iterations (0.5 epochs)',
                       ['main/loss', 'main/accuracy'],
                       ['validation/main/loss', 'validation/main/accuracy'],
                       'validation accuracy'),
    'cifar': ('resnet20 on embedded data: 8 train / 4 test images, '
              'scaling={scaling}, precision={precision}, batch 2, '
              '2 iterations (0.5 epochs)',
              ['main/loss', 'main/accuracy'],
              ['validation/main/loss', 'validation/main/accuracy'],
              'test accuracy'),
}
CPU_NOTE = ('CPU run: simulating mixed precision (--precision sim-fp16); '
            'pass --precision mixed16 for real float16 arithmetic.')
# The SSD example's own default on the embedded data, on a CPU: FP8 E5M2,
# where its small SSD loses gradient values without scaling.
SSD_CPU_NOTE = ('CPU run on the embedded data: simulating FP8 E5M2 '
                'gradients (--precision sim-fp8-e5m2), where the small SSD '
                'loses gradient values without scaling (in FP16 it hardly '
                'does); pass --precision sim-fp16 for FP16.')


def printed_lines(capsys):
    """What the run printed, without the progress bar's cursor moves."""
    text = re.sub(r'\x1b\[\d*[A-Z]', '', capsys.readouterr().out)
    return text.splitlines()


def run(example, out, *options):
    path, smoke_options, metric = SMOKE[example]
    argv = ['--iteration', '2', '--log-interval', '1', '--no-plot',
            '--out', str(out)] + list(smoke_options) + list(options)
    return load_example(path).main(argv), metric


def assert_empty(out):
    assert not os.path.exists(out) or os.listdir(out) == [], os.listdir(out)


@pytest.mark.parametrize('scaling', SCALING_MODES)
@pytest.mark.parametrize('example', sorted(SMOKE))
def test_smoke(example, scaling, tmp_path, capsys):
    out = tmp_path / 'out'
    options = ['--scaling', scaling]
    if scaling == 'gs':
        options += ['--update-interval', '1']
    if example != 'classification':  # (its snapshot: a test below)
        options += ['--snapshot-interval', '2']
    capsys.readouterr()
    result, metric = run(example, out, *options)
    log = read_log(out)
    assert len(log) == 2
    value = last(log, metric)
    assert 0 <= value <= 1
    assert result == pytest.approx(value)
    skips = last(log, 'scaling/skips')
    assert skips in (0, 1, 2)
    # The printed summary, line for line.
    start, train_keys, validation_keys, label = PRINTED[example]
    lines = printed_lines(capsys)
    cpu_precision = 'sim-fp8-e5m2' if example == 'ssd' else 'sim-fp16'
    expected = [start.format(scaling=scaling, precision='fp32' if scaling
                             == 'fp32' else cpu_precision)]
    if scaling != 'fp32':
        expected.insert(0, SSD_CPU_NOTE if example == 'ssd' else CPU_NOTE)
    assert lines[:len(expected)] == expected
    assert lines[len(expected)].split() == (
        ['epoch', 'iteration', 'lr'] + train_keys +
        ['scaling/skips', 'scaling/max_scale'] + validation_keys +
        ['elapsed_time'])
    assert lines[-1] == 'Final {}: {:.4f} ({} skipped steps)'.format(
        label, value, int(skips))
    assert math.isfinite(last(log, 'main/loss'))
    assert any(name.startswith('model_iter_2') for name in os.listdir(out))
    # What the run wrote loads with pickle disabled (no object arrays).
    for name in os.listdir(out):
        if name.startswith(('model_iter_', 'snapshot_iter_')):
            assert len(files.check(str(out / name))) > 20
    if scaling == 'gs':
        # ScaleHistory recorded the GS sites at each refresh.
        with open(out / 'scales.csv') as f:
            rows = f.read().splitlines()
        assert rows[0].startswith('iteration,site,kind')
        assert len(rows) > 2


@pytest.mark.parametrize('example', sorted(SMOKE))
def test_same_seed_same_run(example, tmp_path):
    """--seed fixes the run: ChainerCV's augmentation draws from Python's
    ``random``, which the scripts seed with NumPy's."""
    losses = []
    for name in ('a', 'b', 'a'):
        out = tmp_path / name
        if name == 'a' and losses:
            random.seed(12345)  # another state before the third run
            np.random.seed(12345)
            shutil.rmtree(out)
        run(example, out, '--scaling', 'none', '--seed', '3')
        losses.append([entry['main/loss'] for entry in read_log(out)])
    assert losses[0] == losses[1] == losses[2]


# Each script's own options, in the order --help lists them, with their
# defaults (the scaling options after them are the library's).
OPTIONS = {
    'ssd': [('dataset', 'embedded'), ('data_dir', None),
            ('label_names', None), ('train_split', 'trainval'),
            ('test_split', 'test'), ('model', None), ('input_size', None),
            ('pretrained_model', None), ('batchsize', None),
            ('iteration', None), ('step', None), ('lr', None),
            ('eval_interval', None), ('log_interval', 10), ('gpu', -1),
            ('loaderjob', 0), ('out', 'result/ssd'), ('resume', None),
            ('snapshot_interval', None), ('snapshot_keep', 3), ('seed', 0),
            ('no_plot', False)],
    'segnet': [('dataset', 'embedded'), ('data_dir', None),
               ('train_split', 'train'), ('test_split', 'test'),
               ('label_names', None), ('ignore_label', None),
               ('crop_size', None), ('class_weight', None),
               ('embedded_size', None), ('embedded_image_size', [32, 48]),
               ('batchsize', None), ('iteration', None), ('lr', None),
               ('loss_pixels', None),
               ('eval_interval', None), ('log_interval', 10), ('gpu', -1),
               ('loaderjob', 0), ('out', 'result/segnet'), ('resume', None),
               ('snapshot_interval', None), ('snapshot_keep', 3),
               ('seed', 0), ('no_plot', False)],
    'cifar': [('dataset', 'embedded'), ('data_dir', None),
              ('arch', 'resnet20'), ('embedded_size', None),
              ('batchsize', None), ('iteration', None), ('epoch', None),
              ('lr', None), ('eval_interval', None), ('log_interval', 10),
              ('gpu', -1), ('loaderjob', 0), ('out', 'result/cifar'),
              ('resume', None), ('snapshot_interval', None),
              ('snapshot_keep', 3), ('seed', 0), ('no_plot', False)],
    'classification': [
        ('dataset', 'embedded'), ('data_dir', None), ('arch', 'resnet18'),
        ('communicator', 'naive'), ('embedded_size', None),
        ('batchsize', None), ('iteration', None), ('epoch', None),
        ('lr', None), ('eval_interval', None), ('log_interval', 10),
        ('gpu', -1), ('loaderjob', 0), ('out', 'result/classification'),
        ('resume', None), ('snapshot_interval', None),
        ('snapshot_keep', 3), ('seed', 0), ('no_plot', False)],
}


@pytest.mark.parametrize('example', sorted(SMOKE))
def test_command_line(example, capsys):
    module = load_example(SMOKE[example][0])
    with pytest.raises(SystemExit):
        module.parse_args(['--help'])
    help_text = capsys.readouterr().out
    listed = re.findall(r'^  (--[a-z-]+)', help_text, flags=re.M)
    names = [name for name, _ in OPTIONS[example]]
    assert listed[:len(names) + 1] == ['--' + n.replace('_', '-')
                                       for n in names] + ['--scaling']
    args = vars(module.parse_args([]))
    assert [(name, args[name]) for name in names] == OPTIONS[example]
    # The docstring's first line describes the script.
    assert module.__doc__.split('\n')[0] in help_text


def test_ssd_embedded_lr_follows_the_model():
    # A random VGG-16 (SSD300/512 on the embedded data) diverges at the
    # small SSD's lr 1e-2 (FP32 loss 14.5, 67.6, 138559): it gets 1e-3.
    module = load_example(os.path.join(EXAMPLES, 'ssd', 'train.py'))
    train = ShapesDetectionDataset('train', size=8)
    for argv, lr in (([], 1e-2), (['--model', 'ssd300'], 1e-3),
                     (['--model', 'ssd512'], 1e-3),
                     (['--model', 'ssd300', '--lr', '0.05'], 0.05)):
        args = module.parse_args(argv)
        module.apply_defaults(args, train)
        assert args.lr == lr, argv


def test_segnet_loss_pixels(tmp_path):
    """--loss-pixels leaves FP32 training as it was and makes the softmax
    gradients as small as at the paper's scale: unscaled, FP16 loses many."""
    def losses_and_underflow(name, *options):
        out = tmp_path / name
        run('segnet', out, '--iteration', '3', *options)
        log = read_log(out)
        return ([e['main/loss'] for e in log],
                [e.get('scaling/measured_underflow') for e in log])
    plain, _ = losses_and_underflow('fp32', '--scaling', 'fp32')
    paper, _ = losses_and_underflow('fp32-paper', '--scaling', 'fp32',
                                    '--loss-pixels', '2073600')
    np.testing.assert_allclose(paper, plain, rtol=1e-4)
    fp16 = ['--scaling', 'none', '--precision', 'sim-fp16',
            '--count-underflow']
    _, lost = losses_and_underflow('fp16', *fp16)
    _, lost_paper = losses_and_underflow('fp16-paper', *fp16,
                                         '--loss-pixels', '2073600')
    # Measured: 0.04% against 14-18% of all GEMM gradient values.
    assert max(lost) < 0.01 and min(lost_paper) > 0.05, (lost, lost_paper)


def test_segnet_plots_and_resume(tmp_path):
    out = tmp_path / 'out'
    path, options, _ = SMOKE['segnet']
    segnet = load_example(path)
    argv = ['--log-interval', '1', '--out', str(out),
            '--snapshot-interval', '1'] + options
    segnet.main(argv + ['--iteration', '1'])
    assert {'loss.png', 'snapshot_iter_1'} <= set(os.listdir(out))
    segnet.main(argv + ['--iteration', '2', '--resume',
                        str(out / 'snapshot_iter_1')])
    log = read_log(out)
    # The resumed run continued at iteration 2 and evaluated there.
    assert [e['iteration'] for e in log] == [1, 2]
    assert 'validation/main/miou' in log[-1]
    assert 'miou.png' in os.listdir(out)


def test_classification_snapshot(tmp_path):
    out = tmp_path / 'out'
    path, options, _ = SMOKE['classification']
    load_example(path).main(
        ['--iteration', '1', '--out', str(out), '--no-plot', '--arch',
         'resnet18'] + options[:-2] + ['--snapshot-interval', '1'])
    assert 'snapshot_iter_1' in os.listdir(out)
    assert len(files.check(str(out / 'snapshot_iter_1'))) > 100


def test_step_schedule():
    schedule = schedules.StepSchedule(0.4, warmup=10, warmup_lr=0.1,
                                      steps=(60, 80))
    lrs = [schedule.lr_at(t) for t in (0, 5, 10, 59, 60, 80, 100)]
    assert lrs == pytest.approx([0.1, 0.25, 0.4, 0.4, 0.04, 0.004, 0.004])
    goyal = load_example(SMOKE['classification'][0]).goyal_schedule(
        0.4, total_batch=1024, iteration=900)
    assert (goyal.warmup, goyal.warmup_lr, goyal.steps) == (
        50, 0.1, (300, 600, 800))
    # The lrs of Chainer's ExponentialShift, bit for bit (0.1 * 0.1 ** 2
    # is not 0.001).
    plain = schedules.StepSchedule(0.1, steps=(7, 10))
    assert [plain.lr_at(t) for t in (6, 7, 10)] == [0.1, 0.1 * 0.1,
                                                    0.1 * 0.1 ** 2]


def test_cifar_resumed_after_its_last_lr_step(tmp_path):
    """Resumed after the last lr step, a run goes on at the stepped lr
    (Chainer's ExponentialShift went back to the initial 0.1 there)."""
    cifar = load_example('cifar/train.py')
    argv = ['--iteration', '14', '--snapshot-interval', '10', '--no-plot',
            '--batchsize', '2', '--embedded-size', '4', '2',
            '--log-interval', '1']
    cifar.main(argv + ['--out', str(tmp_path / 'a')])
    cifar.main(argv + ['--out', str(tmp_path / 'b'), '--resume',
                       str(tmp_path / 'a' / 'snapshot_iter_10')])
    straight, resumed = (read_log(tmp_path / name) for name in 'ab')
    assert [e['iteration'] for e in resumed] == list(range(1, 15))
    assert [e['lr'] for e in resumed] == [e['lr'] for e in straight]
    assert resumed[-1]['lr'] == pytest.approx(0.001)


# --- data layouts and bad input -------------------------------------------

def to_pil(img):
    return Image.fromarray(img.transpose(1, 2, 0).round().clip(0, 255)
                           .astype(np.uint8))


def write_voc(root, names, n_train=4, n_val=2):
    """A VOC-layout copy of the embedded detection data, renamed labels."""
    for sub in ('JPEGImages', 'Annotations', 'ImageSets/Main'):
        os.makedirs(os.path.join(root, sub))
    dataset = ShapesDetectionDataset('train', size=n_train + n_val)
    ids = []
    for i in range(n_train + n_val):
        img, bbox, label = dataset[i]
        id_ = '{:06d}'.format(i)
        ids.append(id_)
        to_pil(img).save(os.path.join(root, 'JPEGImages', id_ + '.jpg'))
        annotation = ET.Element('annotation')
        ET.SubElement(annotation, 'filename').text = id_ + '.jpg'
        for box, lb in zip(bbox, label):
            obj = ET.SubElement(annotation, 'object')
            ET.SubElement(obj, 'name').text = names[lb]
            ET.SubElement(obj, 'difficult').text = '0'
            bndbox = ET.SubElement(obj, 'bndbox')
            for tag, value in zip(('ymin', 'xmin', 'ymax', 'xmax'), box):
                # VOC coordinates are 1-based.
                ET.SubElement(bndbox, tag).text = str(int(value) + 1)
        ET.ElementTree(annotation).write(
            os.path.join(root, 'Annotations', id_ + '.xml'))
    for split, split_ids in (('train', ids[:n_train]),
                             ('val', ids[n_train:])):
        with open(os.path.join(root, 'ImageSets', 'Main',
                               split + '.txt'), 'w') as f:
            f.write('\n'.join(split_ids) + '\n')
    return ids


VOC_NAMES = ('square', 'disc', 'wedge')


def voc_argv(data_dir, out):
    return ['--dataset', 'voc-format', '--data-dir', str(data_dir),
            '--label-names', ','.join(VOC_NAMES), '--train-split', 'train',
            '--test-split', 'val', '--model', 'small', '--iteration', '2',
            '--batchsize', '2',
            '--log-interval', '1', '--no-plot', '--out', str(out)]


def test_ssd_voc_format_custom_labels(tmp_path):
    write_voc(tmp_path / 'voc', VOC_NAMES)
    out = tmp_path / 'out'
    result = load_example('ssd/train.py').main(
        voc_argv(tmp_path / 'voc', out))
    log = read_log(out)
    assert result == pytest.approx(last(log, 'validation/main/map'))
    # The evaluator knows the custom classes by name.
    assert any('validation/main/ap/' + name in log[-1]
               for name in VOC_NAMES)


def corrupt_xml(root, id_):
    with open(os.path.join(root, 'Annotations', id_ + '.xml'), 'w') as f:
        f.write('<annotation><object><name>square</name>')
    return id_ + '.xml'


def unknown_label(root, id_):
    path = os.path.join(root, 'Annotations', id_ + '.xml')
    tree = ET.parse(path)
    tree.find('object/name').text = 'hexagon'
    tree.write(path)
    return id_ + '.xml'


def missing_image(root, id_):
    os.remove(os.path.join(root, 'JPEGImages', id_ + '.jpg'))
    return id_ + '.jpg'


@pytest.mark.parametrize('damage', [corrupt_xml, unknown_label,
                                    missing_image])
def test_ssd_voc_format_errors_name_the_file(damage, tmp_path):
    ids = write_voc(tmp_path / 'voc', VOC_NAMES)
    name = damage(str(tmp_path / 'voc'), ids[1])
    out = tmp_path / 'out'
    ssd = load_example('ssd/train.py')
    with pytest.raises(DatasetError) as error:
        ssd.main(voc_argv(tmp_path / 'voc', out))
    assert name in str(error.value)
    assert_empty(out)


def test_ssd_error_exit_message(tmp_path):
    ids = write_voc(tmp_path / 'voc', VOC_NAMES)
    unknown_label(str(tmp_path / 'voc'), ids[0])
    out = tmp_path / 'out'
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, 'ssd', 'train.py')] +
        voc_argv(tmp_path / 'voc', out), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith('error: ')
    assert ids[0] + '.xml' in proc.stderr and 'hexagon' in proc.stderr
    assert_empty(out)


def write_camvid(root, n_train=4, n_test=2):
    """A CamVid-layout directory (ChainerCV's lists) from embedded scenes.

    Shapes take CamVid label ids 1..3 on background 0; a strip of id 11
    (CamVid's "unlabelled") checks that it is ignored.
    """
    for split, n in (('train', n_train), ('val', n_test), ('test', n_test)):
        os.makedirs(os.path.join(root, split))
        os.makedirs(os.path.join(root, split + 'annot'))
        dataset = ShapesSegmentationDataset(
            split if split == 'train' else 'test', size=n,
            image_size=(32, 48))
        lines = []
        for i in range(n):
            img, label = dataset[i]
            label = label.astype(np.uint8)
            label[:, :2] = 11
            name = '{}_{:03d}.png'.format(split, i)
            to_pil(img).save(os.path.join(root, split, name))
            Image.fromarray(label).save(
                os.path.join(root, split + 'annot', name))
            lines.append('/SegNet/CamVid/{0}/{1} /SegNet/CamVid/{0}annot/'
                         '{1}'.format(split, name))
        with open(os.path.join(root, split + '.txt'), 'w') as f:
            f.write('\n'.join(lines) + '\n')


def test_segnet_camvid_layout(tmp_path):
    write_camvid(tmp_path / 'camvid')
    out = tmp_path / 'out'
    segnet = load_example('segnet/train.py')
    result = segnet.main(
        ['--dataset', 'camvid', '--data-dir', str(tmp_path / 'camvid'),
         '--iteration', '2', '--batchsize', '2', '--log-interval', '1',
         '--no-plot', '--out', str(out), '--scaling', 'gs'])
    log = read_log(out)
    assert result == pytest.approx(last(log, 'validation/main/miou'))
    assert 'validation/main/iou/Sky' in log[-1]


def test_segnet_camvid_missing_file(tmp_path):
    write_camvid(tmp_path / 'camvid')
    os.remove(str(tmp_path / 'camvid' / 'trainannot' / 'train_002.png'))
    out = tmp_path / 'out'
    segnet = load_example('segnet/train.py')
    with pytest.raises(DatasetError, match='train_002.png'):
        segnet.main(['--dataset', 'camvid', '--data-dir',
                     str(tmp_path / 'camvid'), '--out', str(out)])
    assert_empty(out)


def test_segnet_class_weight_file(tmp_path):
    segnet = load_example('segnet/train.py')
    bad = tmp_path / 'weights.npy'
    np.save(str(bad), np.ones(2, np.float32))
    with pytest.raises(DatasetError, match='weights.npy'):
        segnet.main(['--class-weight', str(bad), '--embedded-size', '4',
                     '2', '--out', str(tmp_path / 'out')])
    assert_empty(tmp_path / 'out')
    train = ShapesSegmentationDataset('train', size=20, image_size=(32, 48))
    weight = segnet.load_class_weight(segnet.parse_args([]), train, 4)
    # Median frequency balancing: the background is the most frequent
    # class, so it weighs least, and the median class weighs about 1.
    assert weight.argmin() == 0
    assert sorted(weight)[1] <= 1 <= sorted(weight)[2]


def test_segnet_stops_when_camvid_is_absent(tmp_path, capsys):
    # A dataset named on the command line is used or the run stops; only
    # the default (embedded) trains on generated data.
    segnet = load_example('segnet/train.py')
    args = segnet.parse_args(['--dataset', 'camvid', '--data-dir',
                              str(tmp_path / 'nowhere')])
    with pytest.raises(DatasetError, match='CamVid not found'):
        segnet.load_datasets(args)
    assert 'embedded' not in capsys.readouterr().out


def write_idx(path, array, magic):
    header = magic.to_bytes(4, 'big') + b''.join(
        n.to_bytes(4, 'big') for n in array.shape)
    with gzip.open(path, 'wb') as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_fashion_mnist(root, n_train=8, n_test=4):
    os.makedirs(root)
    rng = np.random.RandomState(0)
    for split, n in (('train', n_train), ('t10k', n_test)):
        write_idx(os.path.join(root, split + '-images-idx3-ubyte.gz'),
                  rng.randint(0, 256, (n, 28, 28)), 2051)
        write_idx(os.path.join(root, split + '-labels-idx1-ubyte.gz'),
                  np.arange(n) % 10, 2049)


def test_cifar_fashion_mnist_layout(tmp_path):
    write_fashion_mnist(str(tmp_path / 'fm'))
    cifar = load_example('cifar/train.py')
    dataset = FashionMNISTDataset(str(tmp_path / 'fm'), 'train')
    img, label = dataset[3]
    assert img.shape == (3, 32, 32) and img.dtype == np.float32
    assert label == 3
    # Padded by two black pixels, the grey image replicated.
    assert (img[:, :2] == 0).all() and (img[0] == img[2]).all()
    out = tmp_path / 'out'
    result = cifar.main(['--dataset', 'fashion-mnist', '--data-dir',
                         str(tmp_path / 'fm'), '--iteration', '2',
                         '--batchsize', '4', '--log-interval', '1',
                         '--no-plot', '--out', str(out), '--precision',
                         's2fp8', '--scaling', 'gs'])
    assert result == pytest.approx(
        last(read_log(out), 'validation/main/accuracy'))


def test_cifar_truncated_idx_file(tmp_path):
    write_fashion_mnist(str(tmp_path / 'fm'))
    path = str(tmp_path / 'fm' / 't10k-labels-idx1-ubyte.gz')
    with gzip.open(path, 'wb') as f:
        f.write((2049).to_bytes(4, 'big') + (9).to_bytes(4, 'big') + b'\0')
    cifar = load_example('cifar/train.py')
    with pytest.raises(DatasetError, match='t10k-labels-idx1'):
        cifar.main(['--dataset', 'fashion-mnist', '--data-dir',
                    str(tmp_path / 'fm'), '--out', str(tmp_path / 'out')])
    assert_empty(tmp_path / 'out')


@pytest.mark.skipif(
    not os.path.isdir('/usr/share/datasets/fashion-mnist'),
    reason='Debian package dataset-fashion-mnist not installed')
def test_cifar_debian_fashion_mnist():
    cifar = load_example('cifar/train.py')
    args = cifar.parse_args(['--dataset', 'fashion-mnist'])
    train, test, names = cifar.load_datasets(args)
    assert (len(train), len(test), len(names)) == (60000, 10000, 10)
    assert np.bincount(test.labels).tolist() == [1000] * 10


def test_cifar_precisions(tmp_path):
    cifar = load_example('cifar/train.py')
    for precision in ('sim-fp8-e5m2', 'sim-fp8-e4m3', 'sim-bf16'):
        out = tmp_path / precision
        cifar.main(['--iteration', '1', '--batchsize', '2',
                    '--embedded-size', '4', '2', '--no-plot',
                    '--log-interval', '1', '--out', str(out),
                    '--precision', precision])
        assert math.isfinite(last(read_log(out), 'main/loss'))


@pytest.mark.parametrize('where', ['chainer-cache', 'data-dir'])
def test_cifar_cifar10_npz(where, tmp_path, monkeypatch):
    import chainer
    rng = np.random.RandomState(0)
    arrays = {'train_x': rng.randint(0, 256, (6, 3072)),
              'train_y': np.arange(6) % 10, 'test_x': rng.randint(
                  0, 256, (3, 3072)), 'test_y': np.arange(3)}
    cache = tmp_path / 'pfnet' / 'chainer' / 'cifar'
    os.makedirs(str(cache))
    np.savez(str(cache / 'cifar-10.npz'),
             **{k: v.astype(np.uint8) for k, v in arrays.items()})
    monkeypatch.setattr(chainer.dataset.download, '_dataset_root',
                        str(tmp_path if where == 'chainer-cache'
                            else tmp_path / 'elsewhere'))
    cifar = load_example('cifar/train.py')
    argv = ['--dataset', 'cifar10']
    if where == 'data-dir':
        argv += ['--data-dir', str(cache)]
    args = cifar.parse_args(argv)
    train, test, names = cifar.load_datasets(args)
    assert args.dataset == 'cifar10' and names[0] == 'airplane'
    img, label = train[1]
    assert img.shape == (3, 32, 32) and label == 1
    assert img.max() > 1  # in [0, 255], as the other datasets
    assert np.array_equal(img.ravel(), arrays['train_x'][1])
    assert len(test) == 3


def test_classification_imagenet_layout(tmp_path):
    root = tmp_path / 'imagenet'
    for split in ('train', 'val'):
        for c, wnid in enumerate(('n01', 'n02')):
            os.makedirs(str(root / split / wnid))
            for i in range(2):
                img = np.full((3, 40, 48), 60 + 120 * c, np.float32)
                to_pil(img).save(str(root / split / wnid /
                                     '{}.jpg'.format(i)))
    classification = load_example(SMOKE['classification'][0])
    argv = ['--dataset', 'imagenet', '--data-dir', str(root),
            '--iteration', '1', '--batchsize', '2', '--no-plot',
            '--snapshot-interval', '0', '--log-interval', '1']
    result = classification.main(argv + ['--out', str(tmp_path / 'out')])
    assert result == pytest.approx(
        last(read_log(tmp_path / 'out'), 'validation/main/accuracy'))
    shutil.rmtree(str(root / 'val' / 'n02'))
    with pytest.raises(DatasetError, match='n02'):
        classification.main(argv + ['--out', str(tmp_path / 'out2')])
    assert_empty(tmp_path / 'out2')


# --- ChainerMN --------------------------------------------------------------

@pytest.mark.mpi
def test_classification_two_ranks(tmp_path):
    pytest.importorskip('mpi4py')
    command = mpiexec_command()
    if command is None:
        pytest.skip('mpiexec not found')
    out = tmp_path / 'out'
    proc = subprocess.run(
        command + ['-n', '2', sys.executable,
                   os.path.join(EXAMPLES, SMOKE['classification'][0]),
                   '--iteration', '3', '--batchsize', '2', '--embedded-size',
                   '8', '4', '--log-interval', '1', '--no-plot',
                   '--snapshot-interval', '0', '--scaling', 'gs',
                   '--update-interval', '2', '--out', str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Only rank 0 prints and writes.
    assert proc.stdout.count('2 process(es) x batch 2') == 1
    assert proc.stdout.count('Final validation accuracy') == 1
    log = read_log(out)
    assert [e['iteration'] for e in log] == [1, 2, 3]
    assert 0 <= last(log, 'validation/main/accuracy') <= 1


# --- learning (times measured on the 2-core CPU shared with other jobs) ---

@pytest.mark.slow
def test_ssd_learns(tmp_path):
    result = load_example('ssd/train.py').main(
        ['--no-plot', '--out', str(tmp_path / 'out')])
    assert result > 0.6  # measured 0.93 (300 iterations, 100 s)


@pytest.mark.slow
def test_segnet_learns(tmp_path):
    # Chance is about 0.2 (every pixel background); a few CPU minutes.
    result = load_example('segnet/train.py').main(
        ['--no-plot', '--out', str(tmp_path / 'out')])
    assert result > 0.7  # measured 0.86 (200 iterations, 250 s)


@pytest.mark.slow
def test_classification_learns(tmp_path):
    # Ten classes: chance is 0.1.
    result = load_example(SMOKE['classification'][0]).main(
        ['--no-plot', '--snapshot-interval', '0',
         '--out', str(tmp_path / 'out')])
    assert result > 0.6  # measured 0.78 (450 iterations, 340 s)


@pytest.mark.slow
def test_cifar_learns_in_fp8(tmp_path):
    result = load_example('cifar/train.py').main(
        ['--no-plot', '--precision', 'sim-fp8-e5m2',
         '--out', str(tmp_path / 'out')])
    assert result > 0.5  # measured 0.76 (300 iterations, 510 s)


def test_segnet_embedded_image_size(tmp_path, capsys):
    """--embedded-image-size generates images of that size (CamVid's
    360x480 for a GPU check); a side SegNet cannot pool four times is one
    line."""
    segnet = load_example('segnet/train.py')
    args = segnet.parse_args(['--embedded-image-size', '40', '56',
                              '--embedded-size', '2', '1'])
    train, test, _ = segnet.load_datasets(args)
    assert train[0][0].shape == (3, 40, 56) and test[0][1].shape == (40, 56)
    # Not a multiple of 16: SegNet's unpooling restores the size.
    run('segnet', tmp_path / 'run', '--embedded-image-size', '40', '56',
        '--iteration', '1')
    assert 'validation/main/miou' in read_log(tmp_path / 'run')[-1]
    with pytest.raises(SystemExit) as e:
        segnet.parse_args(['--embedded-image-size', '8', '48'])
    assert e.value.code == 2
    assert 'each side must be at least 16, got 8 48' in capsys.readouterr().err
