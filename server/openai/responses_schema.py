"""The published JSON Schema of /v1/responses request fields that pydantic types
alone would publish too loosely (openai/responses_protocol.py uses these).

Input items and tools are validated one by one (openai/responses_input.py), so
that an error names the item as OpenAI does (`input[2].call_id`): their fields
are typed `dict` for validation, and the document gets their real shape from
here. Each schema states exactly what the validation takes; the refusals no JSON
Schema can state (a call_id that answers no earlier call, arguments that are not
a JSON object) are the ones tests/openapi_hooks.py lists.
"""

from __future__ import annotations

from flashserve.server.openai.protocol import JSON_OBJECT_TEXT, FunctionDefinition

TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
            "required": ["type", "name"],
        },
    ],
    "description": "'required' and a named function need function tools (naming the function)",
}

# Tools as openai/responses_input.py function_tools takes them: a function tool is
# flat ({type: function, name, ...}: FunctionDefinition's fields); a tool of any
# other type is accepted and not offered to the model.
_FUNCTION = FunctionDefinition.model_json_schema()
TOOL_SCHEMA = {
    "anyOf": [
        {
            **_FUNCTION,
            "title": "FunctionTool",
            "properties": {"type": {"const": "function"}, **_FUNCTION["properties"]},
            "required": ["type", *_FUNCTION["required"]],
        },
        {"type": "object", "properties": {"type": {"not": {"const": "function"}}}},
    ],
    "description": "a function tool; tools of other types are accepted and not offered",
}

# The input items as openai/responses_input.py takes them, item by item (the item
# models in responses_protocol.py validate; this is their published shape).
_OPTIONAL_TEXT = {"type": ["string", "null"]}
_TEXT_PARTS = [
    {
        "type": "object",
        "properties": {
            "type": {"enum": ["input_text", "output_text", "text"]},
            "text": {"type": "string"},
            "refusal": _OPTIONAL_TEXT,
        },
        "required": ["type", "text"],
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "refusal"},
            "refusal": {"type": "string"},
            "text": _OPTIONAL_TEXT,
        },
        "required": ["type", "refusal"],
    },
]
# A user's image (a data: URL) for a vision-language model; a text-only model refuses it.
_USER_IMAGE_PART = {
    "type": "object",
    "properties": {"type": {"const": "input_image"}, "image_url": {"type": "string"}},
    "required": ["type", "image_url"],
}
_CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [*_TEXT_PARTS, _USER_IMAGE_PART]}},
    ],
    "description": "text, or text parts (input_text, output_text, refusal) and input_image "
    "parts (image_url: a data: URL, for a vision-language model)",
}
# A function_call_output may also hold images (Codex's view_image tool): the model
# reads a placeholder in their place.
_IMAGE_PART = {
    "type": "object",
    "properties": {"type": {"const": "input_image"}},
    "required": ["type"],
}
_OUTPUT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [*_TEXT_PARTS, _IMAGE_PART]}},
    ],
    "description": "text, or text parts and input_image parts (a vision-language model "
    "sees the image; a text-only model reads a placeholder in its place)",
}
_ITEM_FIELDS = {"id": _OPTIONAL_TEXT, "status": _OPTIONAL_TEXT}
_CALL_ID = {"type": "string", "minLength": 1}
_REASONING_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "type": {"enum": ["reasoning_text", "summary_text", "text"]},
            "text": {"type": "string"},
        },
        "required": ["type", "text"],
    },
}
INPUT_ITEM_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": _CONTENT_SCHEMA,
            **_ITEM_FIELDS,
        },
        "required": ["role", "content"],
        "description": "a message (type may be left out)",
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "function_call"},
            "call_id": _CALL_ID,
            "name": {"type": "string", "minLength": 1},
            "arguments": {"type": "string", **JSON_OBJECT_TEXT},
            **_ITEM_FIELDS,
        },
        "required": ["type", "call_id", "name", "arguments"],
        "description": "a call the model made; arguments: a JSON object as text (or empty)",
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "function_call_output"},
            "call_id": _CALL_ID,
            "output": _OUTPUT_SCHEMA,
            **_ITEM_FIELDS,
        },
        "required": ["type", "call_id", "output"],
        "description": "the result of a function_call earlier in the conversation (call_id)",
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "reasoning"},
            "summary": _REASONING_PARTS,
            "content": {"anyOf": [_REASONING_PARTS, {"type": "null"}]},
            "encrypted_content": _OPTIONAL_TEXT,
            **_ITEM_FIELDS,
        },
        "required": ["type"],
    },
]
INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": INPUT_ITEM_SCHEMAS}},
        {"type": "null"},
    ],
    "description": "a user message, or items: message, function_call, function_call_output, "
    "reasoning; required (a string or at least one item) without previous_response_id",
}
# `input` may be left out (or empty) only where previous_response_id continues a
# stored conversation, which is never empty.
INPUT_OR_PREVIOUS = {
    "anyOf": [
        {
            "properties": {
                "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}
            },
            "required": ["input"],
        },
        {
            "properties": {"previous_response_id": {"type": "string"}},
            "required": ["previous_response_id"],
        },
    ]
}

# text.format: json_schema needs `schema` (TextFormat._schema_given).
TEXT_FORMAT_SCHEMA = {
    "anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"properties": {"schema": {"type": "object"}}, "required": ["schema"]},
    ]
}
