"""KFP container components of the ShardRL stages and the images they run in."""

from .images import SERVICE_IMAGES, STAGE_IMAGES, ImageSpec, image_ref
from .stages import stage_component

__all__ = ["SERVICE_IMAGES", "STAGE_IMAGES", "ImageSpec", "image_ref", "stage_component"]
