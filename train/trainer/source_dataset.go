package trainer

import (
	"fmt"
	"os"
	"strings"

	"distill/cache"
	"distill/data"
	"distill/data/tokenizer"
	"distill/internal/errkind"
	"distill/train"
)

// datasetSource is the Source of a dataset with no teacher (data.dataset,
// SFT): package data reads and tokenizes its files with the student's
// tokenizer, and a goroutine tokenizes ahead of the step (dsStream).
type datasetSource struct {
	dc           *DatasetConfig
	seqLen       int
	globalTokens int
	seed         uint64

	// Set by Open.
	ds      *data.Dataset
	workers int // data.dataset.workers
	maxLen  int // the longest sample data yields (data.dataset.max_len)
	pk      *packer
}

// newDatasetSource checks that the dataset's files are there; Open reads
// them.
func newDatasetSource(cfg *Config) (*datasetSource, error) {
	for i, f := range cfg.Data.Dataset.Files {
		if _, err := os.Stat(f); err != nil {
			return nil, errkind.Errorf(ErrConfig, "data.dataset.files[%d]: %v", i, err)
		}
	}
	return &datasetSource{dc: cfg.Data.Dataset, seqLen: cfg.Data.SeqLen, globalTokens: cfg.Data.GlobalBatchTokens, seed: cfg.Seed,
		pk: &packer{seqLen: cfg.Data.SeqLen, truncate: cfg.Data.Truncate}}, nil
}

// Open opens the dataset with the student's tokenizer, or with none if it
// is pre-tokenized (recordTokenizer).
func (d *datasetSource) Open(p SourceParams) (SourceInfo, error) {
	tok, err := recordTokenizer(d.dc, p.Tokenizer, p.TokenizerDir, p.Student.VocabSize,
		"set model.tokenizer (a directory with tokenizer.json and tokenizer_config.json), or model.init_from a directory that has them")
	if err != nil {
		return SourceInfo{}, err
	}
	opts, err := d.dc.options(d.seqLen)
	if err != nil {
		return SourceInfo{}, err
	}
	d.workers, d.maxLen = opts.Workers, opts.MaxLen
	if d.ds, err = data.Open(d.dc.sources(), tok, opts); err != nil {
		return SourceInfo{}, fmt.Errorf("data.dataset: %w", err)
	}
	m := cache.Manifest{DatasetFingerprint: d.ds.Fingerprint(), Samples: d.ds.Len(), VocabSize: p.Student.VocabSize, TokenizerFingerprint: p.TokenizerFingerprint}
	fmt.Fprintf(p.Log, "dataset: %d samples from %s (fingerprint %.12s)\n", d.ds.Len(), strings.Join(d.dc.Files, ", "), d.ds.Fingerprint())
	return SourceInfo{Manifest: m, Kind: "dataset", NoTeacher: true, ChatTemplate: opts.ChatTemplate}, nil
}

// recordTokenizer is what package data reads dc's records with for a
// student of vocab ids: for a pre-tokenized dataset none (data.IDsOnly:
// the records must be input_ids, checked against vocab), else tok, the
// student's (tokName, if not "", names it), which must have no id past vocab; tok nil
// (only its fingerprint is known) is an ErrConfig whose fix is needTok.
// Training and `student eval` both read a dataset through it, so eval
// needs a tokenizer exactly when training does.
func recordTokenizer(dc *DatasetConfig, tok *tokenizer.Tokenizer, tokName string, vocab int, needTok string) (data.Tokenizer, error) {
	switch {
	case dc.Pretokenized:
		return data.IDsOnly{Vocab: vocab}, nil
	case tok == nil:
		return nil, errkind.Errorf(ErrConfig, "data.dataset: tokenizing the dataset needs the student's tokenizer: %s; if its records are pre-tokenized (input_ids), set data.dataset.pretokenized: true", needTok)
	case tok.VocabSize() > vocab:
		if tokName != "" {
			tokName = " " + tokName
		}
		return nil, errkind.Errorf(ErrMismatch, "the tokenizer%s has %d tokens but the student's vocab_size is %d: token ids past it have no embedding; use a student with vocab_size >= %d",
			tokName, tok.VocabSize(), vocab, tok.VocabSize())
	}
	return tok, nil
}

// Check has nothing to check: Open tokenized the dataset with the
// student's own tokenizer.
func (d *datasetSource) Check(p SourceParams) error { return nil }

// CheckEval has nothing to check: every sample of a dataset is there.
func (d *datasetSource) CheckEval(r cache.Range) error { return nil }

func (d *datasetSource) Batches(held cache.Range, epoch int, pos int64) (Batches, error) {
	// Read ahead two global batches (at least two rows).
	limit := max(2*d.globalTokens, 2*d.seqLen)
	st, err := newDSStream(d.ds, d.seed, held, d.workers, limit, epoch, pos)
	if err != nil {
		return nil, err
	}
	return &packedBatches{st: st, pk: d.pk}, nil
}

func (d *datasetSource) EvalRows(r cache.Range) ([]*train.Batch, int, error) {
	ss, err := dsEvalSamples(d.ds, r)
	if err != nil {
		return nil, 0, err
	}
	return packSamples(d.pk, ss)
}

// packSamples packs samples ss in their order into rows (eval).
func packSamples(pk *packer, ss []cache.Sample) ([]*train.Batch, int, error) {
	return pk.packRows(len(ss), func(k int) (cache.Sample, error) { return ss[k], nil })
}

func (d *datasetSource) Close() {
	if d.ds != nil {
		d.ds.Close()
	}
}

// summary says what the tokenization did, for the training read-ahead
// and the evals together.
func (d *datasetSource) summary() string {
	return fmt.Sprintf("dataset: tokenized %s (training read-ahead and evals together)", statsLine(d.ds.Stats()))
}
