"""`flashserve bench --sections images`: a vision-language model's image turn (imports
anything in the engine). section.py: the image's encode time, and the time to first
token of a prompt with one image, cold and as the next turn of its conversation."""
