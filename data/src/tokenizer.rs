//! Text to tokens and back, for the two tokenizers a run can name
//! ([`gasloc_proto::Tokenizer`]).
//!
//! * GPT-2: tiktoken's `r50k_base` BPE, whose tables are embedded in `tiktoken-rs` (no
//!   download). Text is encoded as ordinary text, so a literal `<|endoftext|>` in a
//!   document is *not* turned into the end-of-text token 50256.
//! * Byte: each UTF-8 byte is a token (vocabulary 256). Token 0 (NUL, which does not
//!   occur in text) is end-of-text.
//!
//! End-of-text separates documents; [`TextTokenizer::encode`] never produces it, and
//! [`TextTokenizer::decode`] renders it as `<|endoftext|>` for both tokenizers.

use gasloc_proto::Tokenizer;
use tiktoken_rs::CoreBPE;

/// How end-of-text appears in decoded text.
pub const END_OF_TEXT_MARK: &str = "<|endoftext|>";

/// A ready-to-use tokenizer.
#[derive(Clone, Copy)]
pub enum TextTokenizer {
    Gpt2(&'static CoreBPE),
    Byte,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextTokenizer({})", self.kind().name())
    }
}

impl From<Tokenizer> for TextTokenizer {
    fn from(kind: Tokenizer) -> Self {
        match kind {
            Tokenizer::Gpt2 => TextTokenizer::Gpt2(tiktoken_rs::r50k_base_singleton()),
            Tokenizer::Byte => TextTokenizer::Byte,
        }
    }
}

impl TextTokenizer {
    pub fn kind(&self) -> Tokenizer {
        match self {
            TextTokenizer::Gpt2(_) => Tokenizer::Gpt2,
            TextTokenizer::Byte => Tokenizer::Byte,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.kind().vocab_size()
    }

    pub fn end_of_text(&self) -> u32 {
        self.kind().end_of_text()
    }

    /// The tokens of `text` (never end-of-text).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            TextTokenizer::Gpt2(bpe) => bpe.encode_ordinary(text),
            TextTokenizer::Byte => text.bytes().map(u32::from).collect(),
        }
    }

    /// The bytes `tokens` stand for; end-of-text becomes `<|endoftext|>` and a token
    /// outside the vocabulary becomes U+FFFD. Not always UTF-8: a token sequence may end
    /// inside a character.
    pub fn decode_bytes(&self, tokens: &[u32]) -> Vec<u8> {
        const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();
        let end_of_text = self.end_of_text();
        let mut bytes = Vec::with_capacity(tokens.len() * 2);
        for &token in tokens {
            if token == end_of_text {
                bytes.extend_from_slice(END_OF_TEXT_MARK.as_bytes());
                continue;
            }
            match self {
                TextTokenizer::Gpt2(bpe) => match bpe.decode_bytes(&[token]) {
                    Ok(piece) => bytes.extend_from_slice(&piece),
                    Err(_) => bytes.extend_from_slice(REPLACEMENT),
                },
                TextTokenizer::Byte => match u8::try_from(token) {
                    Ok(byte) => bytes.push(byte),
                    Err(_) => bytes.extend_from_slice(REPLACEMENT),
                },
            }
        }
        bytes
    }

    /// The text `tokens` stand for (see [`Self::decode_bytes`]); bytes that are not
    /// UTF-8 become U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(tokens)).into_owned()
    }
}
