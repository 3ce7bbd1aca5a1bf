package trainer

import (
	"fmt"
	"io"

	"distill/cache"
)

// takeCacheVocab gives a random student (model.random) the vocabulary and
// tokenizer of the cache it trains on, where the config leaves them unset
// (model.random.vocab_size, and both model.tokenizer and
// model.tokenizer_fingerprint): a student made for the cache, whatever
// teacher filled it. A value the config gives is checked against the
// cache as before. The run's config.yaml records what was taken.
func takeCacheVocab(cfg *Config, m *cache.Manifest, log io.Writer) {
	r := cfg.Model.Random
	if r == nil {
		return
	}
	if r.VocabSize == 0 && m.VocabSize > 0 {
		r.VocabSize = int(m.VocabSize)
		fmt.Fprintf(log, "model.random.vocab_size: %d, the cache's (the config leaves it unset)\n", r.VocabSize)
	}
	if cfg.Model.Tokenizer == "" && cfg.Model.TokenizerFingerprint == "" && m.TokenizerFingerprint != "" {
		cfg.Model.TokenizerFingerprint = m.TokenizerFingerprint
		fmt.Fprintf(log, "model.tokenizer_fingerprint: %.12s, the cache's (the config names no tokenizer)\n", m.TokenizerFingerprint)
	}
}
