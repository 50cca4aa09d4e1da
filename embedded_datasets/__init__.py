"""Small generated datasets in ChainerCV's formats; nothing to download.

Deterministic per ``(seed, split, index)`` and fast to generate, they let the
examples and tests train real models within CPU minutes:

* :class:`ShapesDetectionDataset`: PASCAL VOC format (img, bbox, label).
* :class:`ShapesSegmentationDataset`: CamVid format (img, label map), and
  :func:`class_weights` for SegNet's median-frequency balancing.
* :class:`ShapesClassificationDataset`: label-dataset format (img, label).
"""

from embedded_datasets.classification import \
    shapes_classification_label_names
from embedded_datasets.classification import ShapesClassificationDataset
from embedded_datasets.detection import shapes_label_names
from embedded_datasets.detection import ShapesDetectionDataset
from embedded_datasets.segmentation import class_weights
from embedded_datasets.segmentation import median_frequency_weights
from embedded_datasets.segmentation import shapes_segmentation_label_names
from embedded_datasets.segmentation import ShapesSegmentationDataset

__all__ = ['shapes_classification_label_names', 'ShapesClassificationDataset',
           'shapes_label_names', 'ShapesDetectionDataset', 'class_weights',
           'median_frequency_weights',
           'shapes_segmentation_label_names', 'ShapesSegmentationDataset']
