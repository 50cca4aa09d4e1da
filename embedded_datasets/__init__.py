"""Small generated datasets in ChainerCV's formats; nothing to download.

Deterministic per ``(seed, split, index)`` and fast to generate, they let the
examples and tests train real models within CPU minutes:

* :class:`ShapesDetectionDataset`: PASCAL VOC format (img, bbox, label).
* :class:`ShapesSegmentationDataset`: CamVid format (img, label map), and
  :func:`class_weights` for SegNet's median-frequency balancing.
* :class:`ShapesClassificationDataset`: label-dataset format (img, label).
"""

from embedded_datasets.classification import shapes_classification_label_names  # NOQA
from embedded_datasets.classification import ShapesClassificationDataset  # NOQA
from embedded_datasets.detection import shapes_label_names  # NOQA
from embedded_datasets.detection import ShapesDetectionDataset  # NOQA
from embedded_datasets.segmentation import class_weights  # NOQA
from embedded_datasets.segmentation import shapes_segmentation_label_names  # NOQA
from embedded_datasets.segmentation import ShapesSegmentationDataset  # NOQA
