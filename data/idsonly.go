package data

import "fmt"

// IDsOnly is the Tokenizer of a pre-tokenized dataset (input_ids
// records), for a vocabulary of Vocab ids and no tokenizer files. A
// dataset opened with it is pre-tokenized: every record must hold
// input_ids (text fields beside them are not read), or it is a bad
// record (ErrBadRecord, skipped with Options.SkipBad), since IDsOnly
// encodes no text; the ids are checked against Vocab. Its fingerprint,
// "pretokenized:vocab=V", is what `cachectl fill --pretokenized` records
// as a cache's tokenizer and what a dataset's fingerprint is keyed by, so
// the rule is part of the dataset fingerprint.
type IDsOnly struct{ Vocab int }

func (t IDsOnly) Encode(string) []int32                    { return nil }
func (t IDsOnly) EncodeOffsets(string) ([]int32, [][2]int) { return nil, nil }
func (t IDsOnly) VocabSize() int                           { return t.Vocab }
func (t IDsOnly) TokenID(string) (int32, bool)             { return 0, false }
func (t IDsOnly) Fingerprint() string                      { return PretokenizedFingerprint(t.Vocab) }
func (t IDsOnly) ChatTemplate() string                     { return "" }
func (t IDsOnly) BOS() string                              { return "" }
func (t IDsOnly) EOS() string                              { return "" }
func (t IDsOnly) AddBOS() bool                             { return false }

// PretokenizedFingerprint is the tokenizer fingerprint of pre-tokenized
// data over a vocabulary of vocab ids (IDsOnly's).
func PretokenizedFingerprint(vocab int) string { return fmt.Sprintf("pretokenized:vocab=%d", vocab) }
