"""The studies of ``scripts/reproduce.py``, one module each.

* :mod:`studies.model_fit` (``model``): claim 1, Theorems 1 and 2 against
  measured underflow rates.
* :mod:`studies.figure2` (``figure2``): the mean GS scale per layer of
  SSD300 and SSD512.
* :mod:`studies.segnet` (``segnet``): Figure 3b and the softmax-cast
  underflow of SegNet.
* :mod:`studies.training` (``detection``, ``detection-fp8``,
  ``classification``, ``segmentation``, ``segmentation-paper-loss``):
  FP32, no scaling, Fixed-LS, Dyn-LS and GS compared by runs of the
  example scripts, several seeds.
* :mod:`studies.s2fp8` (``s2fp8``): one more training study, of
  ``examples/cifar/train.py`` in FP32, FP8, S2FP8 and GS.
* :mod:`studies.block_scaling` (``block-scaling``): per-tensor GS against
  the block recipes (MXFP8, FP8 1x128 tiles, NVFP4) on detection,
  classification and segmentation, one table.
* :mod:`studies.segnet_frameworks` (``segnet-frameworks``): SegNet in
  Chainer and PyTorch.
* :mod:`studies.ssd_backbone` (``ssd-backbone``): Table 2's mechanism, the
  scales GS gives SSD's backbone and heads, random or pretrained.
* :mod:`studies.figure3b_long` (``figure3b-long``): Figure 3b at 2000
  iterations, whether the overflow cap binds.
* :mod:`studies.residual` (``residual``): Table 1's residual connections,
  the values lost with and without them.
* :mod:`studies.table2_mechanism` (``table2-mechanism``): FP32, Fixed-LS,
  Chainer's Dyn-LS and GS from a pretrained SSD backbone in E5M2.
* :mod:`studies.verdicts` (``verdicts``): the 2-SE verdicts of the
  comparisons README and docs state, from the runs CSVs (no training).

:mod:`studies.runs` (the subprocess runs, resumable) and
:mod:`studies.summary` (tables, runs CSV, figure) serve the training
studies; :mod:`studies.provenance` records and checks what each results
file was made from; :mod:`studies.fingerprint` verifies a stale file by a
short run with the code then and now (``--check --verify``); :mod:`studies.common` and :mod:`studies.recording`
hold what several studies use.  The studies call the example scripts and the
public API of :mod:`gradient_scaling` only.  ``studies`` is a sibling of
``reproduce.py``: ``python scripts/reproduce.py`` finds it as Python finds
a script's own modules, with no ``sys.path`` edit.
"""
