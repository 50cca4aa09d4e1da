"""The base of every dataset of the package: a plain sequence of examples.

It indexes as ``chainer.dataset.DatasetMixin`` does (``dataset[i]``, a
slice or a list of indices gives a list of examples) without Chainer, so
Chainer's iterators and ``TransformDataset``, and a PyTorch ``DataLoader``,
take the same object.
"""

import numpy as np

__all__ = ['Dataset']


class Dataset(object):
    """A sequence of examples: ``len(dataset)`` and ``dataset[index]``.

    Subclasses define ``__len__`` and :meth:`get_example`; an example is a
    tuple of NumPy arrays.  As in Chainer's ``DatasetMixin``, an integer
    index gives :meth:`get_example`'s tuple, a slice or a list (or array)
    of indices a list of them.

    >>> from example_data._dataset import Dataset
    >>> class Squares(Dataset):
    ...     def __len__(self):
    ...         return 4
    ...     def get_example(self, i):
    ...         return i * i
    >>> Squares()[2], Squares()[1:3]
    (4, [1, 4])
    """

    def __len__(self):
        raise NotImplementedError

    def get_example(self, i):
        """The ``i``-th example."""
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.get_example(i)
                    for i in range(*index.indices(len(self)))]
        if isinstance(index, (list, np.ndarray)):
            return [self.get_example(i) for i in index]
        return self.get_example(index)
