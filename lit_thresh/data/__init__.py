"""LightningDataModules: synthetic MQAR and tokenised text."""

from lit_thresh.data.mqar import MQARDataModule, MQARSetting, multiquery_ar
from lit_thresh.data.text import TextDataModule

__all__ = ["MQARDataModule", "MQARSetting", "TextDataModule", "multiquery_ar"]
