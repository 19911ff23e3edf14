"""Data for fine-tuning: the image-classification, domain-generalization and segmentation LightningDataModules (on
a shared base, :class:`ImageDataModule`, and the :class:`TaskData` protocol the engine reads them through), their
datasets, transforms and splits."""

from .base import ImageDataModule
from .classification import ImageClassificationData
from .datasets import ImageFileDataset, LabeledImageDataset, load_cifar
from .domains import DomainGeneralizationData
from .errors import DataError, ImageDecodeError
from .images import (
    IMAGE_EXTENSIONS,
    SkippedImagesWarning,
    find_bad_images,
    list_image_files,
    load_rgb,
    to_rgb,
)
from .samplers import check_shareable, trained_items
from .segmentation import (
    IGNORE_INDEX,
    SegmentationData,
    SegmentationDataset,
    pad_collate,
    read_class_names,
    read_mask,
    segmentation_eval_transform,
    segmentation_train_transform,
)
from .splits import long_tailed_counts, long_tailed_subset, stratified_split, stratified_subset
from .taskdata import (
    TASK_DATA_MEMBERS,
    TaskData,
    TaskDataDefaults,
    missing_task_data,
    require_task_data,
    train_class_counts,
)
from .transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform, train_transform

__all__ = [
    "IGNORE_INDEX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "TASK_DATA_MEMBERS",
    "DataError",
    "DomainGeneralizationData",
    "ImageClassificationData",
    "ImageDataModule",
    "ImageDecodeError",
    "ImageFileDataset",
    "LabeledImageDataset",
    "SegmentationData",
    "SegmentationDataset",
    "SkippedImagesWarning",
    "TaskData",
    "TaskDataDefaults",
    "check_shareable",
    "eval_transform",
    "find_bad_images",
    "list_image_files",
    "load_cifar",
    "load_rgb",
    "long_tailed_counts",
    "long_tailed_subset",
    "missing_task_data",
    "pad_collate",
    "read_class_names",
    "read_mask",
    "require_task_data",
    "segmentation_eval_transform",
    "segmentation_train_transform",
    "stratified_split",
    "stratified_subset",
    "to_rgb",
    "train_class_counts",
    "train_transform",
    "trained_items",
]
