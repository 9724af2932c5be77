"""One module per traced library: ``lightning`` (the step callback, any Lightning Trainer) and
``rfdetr`` (RF-DETR's ``build_trainer``)."""
