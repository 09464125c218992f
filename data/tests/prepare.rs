//! `data prepare` round trip (text → shards → decode → text) for both tokenizers, and
//! its refusals, which leave nothing behind.

use gasloc_data::{prepare, PrepareOptions, TextTokenizer, TokenDataset};
use gasloc_proto::Tokenizer;
use std::path::{Path, PathBuf};

/// Several documents: a nested directory of `*.txt` files (plus a file that is not
/// `*.txt`, which a directory walk skips) and one explicitly named non-`.txt` file.
/// Returns the inputs to pass and the documents' texts in the order prepare reads them.
fn corpus(root: &Path) -> (Vec<PathBuf>, Vec<String>) {
    let texts = root.join("texts");
    std::fs::create_dir_all(texts.join("more")).unwrap();
    let a =
        "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n";
    let b =
        "Ünïcödé — “quotes”, emoji 🎭, CJK 莎士比亚, and a literal <|endoftext|> in the text.\r\n";
    let c = "";
    let d = "The quality of mercy is not strained;\n\tIt droppeth as the gentle rain from heaven\n"
        .repeat(3);
    let e = "Explicitly named, whatever its extension.";
    std::fs::write(texts.join("a.txt"), a).unwrap();
    std::fs::write(texts.join("b.txt"), b).unwrap();
    std::fs::write(texts.join("more").join("c.txt"), c).unwrap();
    std::fs::write(texts.join("more").join("d.txt"), &d).unwrap();
    std::fs::write(texts.join("more").join("notes.md"), "skipped").unwrap();
    let named = root.join("extra.text");
    std::fs::write(&named, e).unwrap();
    let documents = [a, b, c, &d, e].map(str::to_string).to_vec();
    (vec![texts, named], documents)
}

fn options(inputs: Vec<PathBuf>, out: PathBuf, tokenizer: Tokenizer) -> PrepareOptions {
    PrepareOptions {
        inputs,
        out,
        tokenizer,
        val_tokens: 30,
        shard_tokens: 40,
        progress: false,
    }
}

/// Validation shards, then training shards, each in name order: the whole token stream.
fn token_stream(data: &TokenDataset) -> Vec<u32> {
    let shards = data.val_shards().iter().chain(data.train_shards().unwrap());
    shards.flat_map(|s| s.to_u32_vec()).collect()
}

fn round_trip(tokenizer: Tokenizer) {
    let root = tempfile::tempdir().unwrap();
    let (inputs, documents) = corpus(root.path());
    let out = root.path().join("out").join("corpus");
    let report = prepare(&options(inputs, out.clone(), tokenizer)).unwrap();

    assert_eq!(report.documents, documents.len());
    assert_eq!(report.val_tokens, 30);
    assert_eq!(
        report.input_bytes,
        documents.iter().map(|d| d.len() as u64).sum::<u64>()
    );
    assert_eq!(report.val_shards, vec![out.join("corpus_val_000000.bin")]);
    let expected_train_shards = report.train_tokens.div_ceil(40);
    assert!(
        expected_train_shards >= 2,
        "the corpus must fill several shards"
    );
    let names: Vec<PathBuf> = (0..expected_train_shards)
        .map(|i| out.join(format!("corpus_train_{i:06}.bin")))
        .collect();
    assert_eq!(report.train_shards, names);

    let data = TokenDataset::open(&out, tokenizer.vocab_size()).unwrap();
    assert_eq!(
        (data.train_tokens(), data.val_tokens()),
        (report.train_tokens, 30)
    );
    for shard in data
        .train_shards()
        .unwrap()
        .into_iter()
        .chain(data.val_shards())
    {
        assert!(
            shard.len() <= 40 && !shard.is_empty(),
            "{}",
            shard.path().display()
        );
    }

    // Each document is preceded by end-of-text, and splitting there gives them back.
    let text = TextTokenizer::from(tokenizer);
    let stream = token_stream(&data);
    let eot = tokenizer.end_of_text();
    assert_eq!(stream[0], eot);
    let pieces: Vec<&[u32]> = stream[1..].split(|&t| t == eot).collect();
    assert_eq!(pieces.len(), documents.len());
    for (piece, document) in pieces.iter().zip(&documents) {
        assert_eq!(&text.decode(piece), document);
    }
    let mark = "<|endoftext|>";
    assert_eq!(
        text.decode(&stream),
        format!("{mark}{}", documents.join(mark))
    );

    // Nothing but the shards is left in the output's parent.
    let parent: Vec<_> = std::fs::read_dir(out.parent().unwrap()).unwrap().collect();
    assert_eq!(parent.len(), 1);
}

#[test]
fn byte_data_round_trips_through_shards() {
    round_trip(Tokenizer::Byte);
}

#[test]
fn gpt2_data_round_trips_through_shards() {
    round_trip(Tokenizer::Gpt2);
}

#[test]
fn tokenizers_are_the_real_ones() {
    let gpt2 = TextTokenizer::from(Tokenizer::Gpt2);
    assert_eq!(gpt2.encode("Hello world"), vec![15496, 995]);
    let special_text = gpt2.encode("<|endoftext|>");
    assert!(
        !special_text.contains(&50256) && special_text.len() > 1,
        "{special_text:?}"
    );
    assert_eq!(gpt2.decode(&special_text), "<|endoftext|>");
    assert_eq!(
        gpt2.decode(&[15496, 995, 50256]),
        "Hello world<|endoftext|>"
    );
    assert_eq!(gpt2.decode(&[60_000]), "\u{FFFD}");
    let byte = TextTokenizer::from(Tokenizer::Byte);
    assert_eq!(byte.encode("Aé"), vec![65, 0xC3, 0xA9]);
    assert_eq!(byte.decode(&[65, 0, 0xC3, 0xA9]), "A<|endoftext|>é");
    assert_eq!(byte.decode(&[300]), "\u{FFFD}");
    assert_eq!((byte.vocab_size(), byte.end_of_text()), (256, 0));
}

#[test]
fn shard_size_larger_than_the_data_gives_one_shard_per_split() {
    let root = tempfile::tempdir().unwrap();
    let (inputs, _) = corpus(root.path());
    let out = root.path().join("one");
    let mut opts = options(inputs, out, Tokenizer::Gpt2);
    opts.shard_tokens = 1_000_000;
    opts.val_tokens = 0;
    let report = prepare(&opts).unwrap();
    assert_eq!((report.val_shards.len(), report.train_shards.len()), (0, 1));
    assert!(report.to_string().contains("5 documents"), "{report}");
}

/// `prepare` fails naming `expected`, and leaves neither the output nor a temporary
/// directory behind.
fn assert_refused(opts: &PrepareOptions, expected: &str) {
    let parent = opts.out.parent().unwrap();
    let before: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let message = prepare(opts).unwrap_err().to_string();
    assert!(message.contains(expected), "{expected:?} not in: {message}");
    let after: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(before, after, "prepare left something behind");
}

#[test]
fn bad_inputs_are_refused_and_leave_nothing_behind() {
    let root = tempfile::tempdir().unwrap();
    let (inputs, _) = corpus(root.path());
    let out = root.path().join("out");

    let nul = root.path().join("nul.txt");
    std::fs::write(&nul, "text\0more").unwrap();
    let with = |extra: &Path| [inputs.clone(), vec![extra.to_path_buf()]].concat();
    let opts = options(with(&nul), out.clone(), Tokenizer::Byte);
    assert_refused(&opts, "nul.txt: contains a NUL byte at offset 4");
    // GPT-2 has its own end-of-text token, so NUL is ordinary text there.
    let report = prepare(&options(with(&nul), out.clone(), Tokenizer::Gpt2)).unwrap();
    assert_eq!(report.documents, 6);
    std::fs::remove_dir_all(&out).unwrap();

    let latin1 = root.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    let opts = options(with(&latin1), out.clone(), Tokenizer::Gpt2);
    assert_refused(
        &opts,
        "latin1.txt: not UTF-8 text (invalid byte at offset 3)",
    );

    let missing = root.path().join("missing.txt");
    assert_refused(
        &options(with(&missing), out.clone(), Tokenizer::Byte),
        "missing.txt",
    );

    let empty_dir = root.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let opts = options(vec![empty_dir], out.clone(), Tokenizer::Byte);
    assert_refused(&opts, "empty: a directory with no *.txt files");

    let mut opts = options(inputs.clone(), out.clone(), Tokenizer::Byte);
    opts.val_tokens = 1_000_000;
    assert_refused(&opts, "nothing is left for training");

    opts.val_tokens = 10;
    opts.shard_tokens = 0;
    assert_refused(&opts, "shard_tokens = 0");
}

#[test]
fn an_existing_output_is_never_overwritten() {
    let root = tempfile::tempdir().unwrap();
    let (inputs, _) = corpus(root.path());
    let out = root.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.bin"), "precious").unwrap();
    let opts = options(inputs.clone(), out.clone(), Tokenizer::Byte);
    let message = prepare(&opts).unwrap_err().to_string();
    assert!(
        message.contains("already exists and is not empty"),
        "{message}"
    );
    assert_eq!(std::fs::read(out.join("keep.bin")).unwrap(), b"precious");

    // An empty output directory is fine to fill.
    std::fs::remove_file(out.join("keep.bin")).unwrap();
    prepare(&opts).unwrap();
    assert!(out.join("out_train_000000.bin").is_file());
}
