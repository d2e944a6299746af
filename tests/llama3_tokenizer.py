"""A small tokenizer built the way Meta's Llama 3 ``tokenizer.json`` is (tiktoken's BPE as
``tokenizers`` spells it): the Llama 3 split regex (digits in groups of at most three, letters
with one leading non-letter, ...) then byte-level BPE without a prefix space, ``ignore_merges``,
the special tokens after the BPE vocabulary (<|begin_of_text|>, <|end_of_text|>, header and
end-of-turn tokens, reserved ones) and a post-processor that puts <|begin_of_text|> first.
Only the vocabulary is small: trained here on the given text instead of Meta's 128,000 tokens."""
import json

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The pre-tokenizer regex of Meta's tokenizer.json (tiktoken's cl100k pattern with \p{N}{1,3}).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# In Meta's order (ids 128000-128010 there, then reserved tokens up to 128255).
SPECIALS = [BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
            *(f"<|reserved_special_token_{i}|>" for i in range(3, 8))]
TOKENIZER_CONFIG = {"bos_token": BOS, "eos_token": EOS, "clean_up_tokenization_spaces": True,
                    "model_input_names": ["input_ids", "attention_mask"],
                    "tokenizer_class": "PreTrainedTokenizerFast"}


def build(docs, bpe_vocab: int, whole=()) -> Tokenizer:
    """Trained on ``docs`` to ``bpe_vocab`` BPE tokens, then the pieces in ``whole`` (each one
    piece of the split, e.g. " word") as tokens of their own that no merge builds (Meta's
    vocabulary has such tokens: ignore_merges is what makes them one token), then the 16 special
    tokens."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=bpe_vocab, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if whole:
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for piece in whole:
            vocab.setdefault(byte_level.pre_tokenize_str(piece)[0][0], len(vocab))
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))])])
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = True  # as Meta's: a word in the vocabulary is one token
    return Tokenizer.from_str(json.dumps(spec))
