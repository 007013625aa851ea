"""GRU encoder-decoder with attention, and a toy translation task generated offline.

Toy task (:func:`make_toy_translation`): a source sentence is a random string of content
tokens; its "translation" is the sentence reversed with every token mapped through a fixed
permutation of the content vocabulary (:func:`toy_vocab_map`).  Token ids: ``PAD = 0``,
``BOS = 1``, ``EOS = 2``, content tokens ``3 .. vocab - 1``; source and target share a vocab.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
_MAP_SEED = 20160101  # the permutation depends on the vocabulary size only


def toy_vocab_map(vocab: int) -> np.ndarray:
    """The fixed token translation table of the toy task.

    Args:
      vocab: Vocabulary size (> 3), special tokens included.

    Returns:
      int32 [vocab]: ``table[src_token] = tgt_token``; special tokens map to themselves and
      content tokens ``3 .. vocab - 1`` through a permutation fixed by ``vocab``.
    """
    if vocab <= NUM_SPECIAL:
        raise ValueError(f"vocab must exceed {NUM_SPECIAL}, got {vocab}")
    perm = np.random.default_rng(_MAP_SEED + vocab).permutation(vocab - NUM_SPECIAL)
    return np.concatenate([np.arange(NUM_SPECIAL), perm + NUM_SPECIAL]).astype(np.int32)


def make_toy_translation(num_samples: int, seed: int, src_vocab: int = 16, max_len: int = 8,
                         min_len: int = 2
                         ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Generates the toy translation pairs (deterministic for a seed).

    For a source of length ``L`` (uniform in ``[min_len, max_len]``) with content tokens
    ``x``, the target is ``y = toy_vocab_map(src_vocab)[x[::-1]]``.  Sequences are right
    padded with ``PAD``; ``S = T = max_len + 1``.

    Args:
      num_samples: Number of pairs ``N``.
      seed: Seed of the sampler.
      src_vocab: Vocabulary size (source and target), special tokens included.
      max_len: Longest sentence (content tokens).
      min_len: Shortest sentence.

    Returns:
      ``((enc_in, dec_in), dec_target)``: ``enc_in`` int32 [N, S] is ``x + [EOS]``;
      ``dec_in`` int32 [N, T] is ``[BOS] + y`` (teacher forcing); ``dec_target`` int32
      [N, T] is ``y + [EOS]``.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    table = toy_vocab_map(src_vocab)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_samples)
    tokens = rng.integers(NUM_SPECIAL, src_vocab, size=(num_samples, max_len))
    enc_in = np.zeros((num_samples, max_len + 1), np.int32)
    dec_in = np.zeros_like(enc_in)
    dec_target = np.zeros_like(enc_in)
    for i, n in enumerate(lengths):
        x = tokens[i, :n]
        y = table[x[::-1]]
        enc_in[i, :n], enc_in[i, n] = x, EOS
        dec_in[i, 0], dec_in[i, 1:n + 1] = BOS, y
        dec_target[i, :n], dec_target[i, n] = y, EOS
    return (enc_in, dec_in), dec_target


def lstm_nmt(src_vocab: int, tgt_vocab: int, embed_dim: int = 32, units: int = 64,
             seed: int | None = None) -> keras.Model:
    """:func:`gru_nmt` with LSTM layers (the decoder starts from the encoder's final
    ``[h, c]``); the same task, inputs and outputs."""
    return gru_nmt(src_vocab, tgt_vocab, embed_dim, units, seed, cell="lstm")


def gru_nmt(src_vocab: int, tgt_vocab: int, embed_dim: int = 32, units: int = 64,
            seed: int | None = None, cell: str = "gru") -> keras.Model:
    """GRU encoder-decoder with Luong (dot-product) attention, trained by teacher forcing.

    Encoder: ``Embedding(mask_zero=True)`` -> ``GRU(return_sequences, return_state)``.
    Decoder: ``Embedding`` -> ``GRU`` started from the encoder's final state; a dot-product
    ``Attention`` of the decoder outputs over the encoder outputs (PAD positions masked);
    ``Concatenate([decoder, context])`` -> ``attn_proj`` (tanh, ``units``) -> ``logits``.  The
    two position-wise dense layers are ``EinsumDense``: a ``Dense`` on [N, T, d] inputs with
    dynamic N and T gets a kernel gradient of static shape (None, units) in TF graphs, which
    the block selection rejects.  The decoder needs no mask: padding follows EOS, and the
    GRU is causal, so it cannot reach earlier steps; the loss (:func:`masked_sparse_ce`)
    ignores those positions.

    Args:
      src_vocab: Source vocabulary size (``PAD = 0``).
      tgt_vocab: Target vocabulary size (``PAD = 0``).
      embed_dim: Embedding width.
      units: GRU width.
      seed: Optional seed for the initialisers (sets Keras' global random seed).
      cell: ``"gru"`` or ``"lstm"`` (:func:`lstm_nmt`).

    Returns:
      An uncompiled ``keras.Model`` taking ``[enc_in [N, S], dec_in [N, T]]`` (int32) and
      returning logits [N, T, tgt_vocab].

    Raises:
      ValueError: ``cell`` is neither.
    """
    if cell not in ("gru", "lstm"):
        raise ValueError(f"`cell` must be 'gru' or 'lstm', got {cell!r}")
    rnn = keras.layers.GRU if cell == "gru" else keras.layers.LSTM
    if seed is not None:
        keras.utils.set_random_seed(seed)
    enc_in = keras.Input((None,), dtype="int32", name="enc_in")
    dec_in = keras.Input((None,), dtype="int32", name="dec_in")
    enc_emb = keras.layers.Embedding(src_vocab, embed_dim, mask_zero=True,
                                     name="enc_embed")(enc_in)
    enc_out, *enc_state = rnn(units, return_sequences=True, return_state=True,
                              name=f"enc_{cell}")(enc_emb)
    dec_emb = keras.layers.Embedding(tgt_vocab, embed_dim, name="dec_embed")(dec_in)
    dec_out = rnn(units, return_sequences=True, name=f"dec_{cell}")(
        dec_emb, initial_state=enc_state)
    enc_mask = ops.not_equal(enc_in, PAD)
    context = keras.layers.Attention(name="attention")([dec_out, enc_out],
                                                       mask=[None, enc_mask])
    x = keras.layers.Concatenate(name="concat")([dec_out, context])
    x = keras.layers.EinsumDense("btd,du->btu", (None, units), bias_axes="u",
                                 activation="tanh", name="attn_proj")(x)
    logits = keras.layers.EinsumDense("btu,uv->btv", (None, tgt_vocab), bias_axes="v",
                                      name="logits")(x)
    return keras.Model([enc_in, dec_in], logits, name=f"{cell}_nmt")


def masked_sparse_ce(y_true: keras.KerasTensor, y_pred: keras.KerasTensor
                     ) -> keras.KerasTensor:
    """Mean token cross-entropy over non-PAD targets.

    Args:
      y_true: int [N, T] target ids (``PAD = 0`` ignored).
      y_pred: float [N, T, V] logits.

    Returns:
      Scalar: summed cross-entropy of non-PAD tokens over their count.
    """
    y_true = ops.cast(y_true, "int32")
    ce = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    mask = ops.cast(ops.not_equal(y_true, PAD), ce.dtype)
    return ops.sum(ce * mask) / ops.maximum(ops.sum(mask), 1.0)


def token_accuracy(y_true: keras.KerasTensor, y_pred: keras.KerasTensor) -> keras.KerasTensor:
    """Fraction of non-PAD target tokens whose argmax prediction is right.

    Args:
      y_true: int [N, T] target ids (``PAD = 0`` ignored).
      y_pred: float [N, T, V] logits.

    Returns:
      Scalar accuracy of the batch.
    """
    y_true = ops.cast(y_true, "int32")
    hit = ops.cast(ops.equal(ops.cast(ops.argmax(y_pred, axis=-1), "int32"), y_true), "float32")
    mask = ops.cast(ops.not_equal(y_true, PAD), "float32")
    return ops.sum(hit * mask) / ops.maximum(ops.sum(mask), 1.0)


def greedy_translate(model: keras.Model, enc_in: np.ndarray, max_len: int) -> np.ndarray:
    """Greedy decoding (re-runs the decoder on the growing prefix; fine for toy sizes).

    Args:
      model: A :func:`gru_nmt` model.
      enc_in: int32 [N, S] source ids.
      max_len: Tokens to generate ``L``.

    Returns:
      int32 [N, L] output ids, ``EOS`` included, ``PAD`` after it.
    """
    enc_in = np.asarray(enc_in, np.int32)
    n = enc_in.shape[0]
    dec = np.full((n, max_len + 1), PAD, np.int32)
    dec[:, 0] = BOS
    done = np.zeros(n, bool)
    for t in range(max_len):
        logits = model([enc_in, dec[:, :t + 1]], training=False)
        token = np.argmax(np.asarray(logits)[:, t], axis=-1).astype(np.int32)
        dec[:, t + 1] = np.where(done, PAD, token)
        done |= token == EOS
        if done.all():
            break
    return dec[:, 1:]
