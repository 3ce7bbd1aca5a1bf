package cache

import (
	"encoding/binary"
	"fmt"
	"path/filepath"

	badger "github.com/dgraph-io/badger/v4"
)

// CheckReport is the result of Check: what was examined and every problem
// found, each naming the chunk or sample.
type CheckReport struct {
	// Manifest is the cache's manifest.
	Manifest Manifest
	// Chunks and Samples count the committed chunks and samples examined.
	Chunks, Samples, Tokens, Bytes int64
	// Problems lists every inconsistency found, one line each.
	Problems []string
}

// OK reports whether no problem was found.
func (r *CheckReport) OK() bool { return len(r.Problems) == 0 }

// Check is the fsck behind `cachectl verify`: under the shared lock it
// reads the index, then checks that every chunk record points at a chunk
// file whose size, CRC-32C, schema, row count, sample indices and token
// count match, and whose samples all decode; that every sample key points
// at a committed chunk and the row of that sample; that every sample of
// every chunk has a key; and that chunks/ holds no unreferenced file. It
// returns an error only when it cannot run at all.
func Check(dir string, opts *Options) (*CheckReport, error) {
	o := opts.withDefaults()
	s, err := openIndex(dir, false, o.LockTimeout)
	if err != nil {
		return nil, err
	}
	rep := &CheckReport{}
	m, ok, err := s.manifest()
	if err == nil && !ok {
		err = fmt.Errorf("%w: %s: index has no manifest", ErrNotCache, dir)
	}
	if err == nil {
		err = m.Validate()
	}
	var rs []ChunkInfo
	if err == nil {
		rs, err = s.ranges()
	}
	if err != nil {
		s.close()
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	rep.Manifest = m
	problem := func(format string, a ...any) { rep.Problems = append(rep.Problems, fmt.Sprintf(format, a...)) }
	// Sample keys: stream them once, in order, against the sorted chunks.
	keyed := make([]int64, len(rs))
	err = s.db.View(func(txn *badger.Txn) error {
		io := badger.DefaultIteratorOptions
		io.Prefix = []byte{keySamplePref}
		it := txn.NewIterator(io)
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			item := it.Item()
			k := item.Key()
			v, err := item.ValueCopy(nil)
			if err != nil {
				return err
			}
			if len(k) != 9 || len(v) != 12 {
				problem("index: malformed sample key %x", k)
				continue
			}
			i := int64(binary.BigEndian.Uint64(k[1:]))
			start, row := int64(binary.BigEndian.Uint64(v)), int64(binary.BigEndian.Uint32(v[8:]))
			c := findOverlap(rs, Range{i, i + 1})
			switch {
			case c < 0:
				problem("index: sample %d points at chunk starting at %d, which is not committed", i, start)
			case rs[c].Start != start || row != i-start:
				problem("index: sample %d points at chunk %d row %d, but it lives in %s row %d", i, start, row, rs[c].File, i-rs[c].Start)
			default:
				keyed[c]++
			}
		}
		return nil
	})
	// List chunks/ while the shared lock still excludes commits: a chunk
	// renamed in after the index was read would look unreferenced.
	names, lerr := o.FS.ReadDir(filepath.Join(dir, chunksDir))
	s.close()
	if err != nil {
		return nil, fmt.Errorf("cache: %s: reading index: %w", dir, err)
	}
	ref := map[string]bool{}
	for ci, info := range rs {
		rep.Chunks++
		rep.Samples += info.Len()
		rep.Tokens += info.Tokens
		rep.Bytes += info.Bytes
		ref[info.File] = true
		if info.File != chunkFileName(info.Range) {
			problem("chunk %v: file name %q, want %q", info.Range, info.File, chunkFileName(info.Range))
		}
		if ci > 0 && rs[ci-1].End > info.Start {
			problem("chunk %s overlaps chunk %s", info.File, rs[ci-1].File)
		}
		if info.End > m.Samples {
			problem("chunk %s ends past the manifest's %d samples", info.File, m.Samples)
		}
		if keyed[ci] != info.Len() {
			problem("chunk %s: %d of its %d samples have index entries", info.File, keyed[ci], info.Len())
		}
		if err := checkChunk(o.FS, dir, &m, info); err != nil {
			problem("%v", err)
		}
	}
	if lerr != nil {
		problem("listing %s: %v", filepath.Join(dir, chunksDir), lerr)
	}
	for _, n := range names {
		if !ref[n] {
			problem("chunks/%s is not referenced by the index (left by a crashed writer; run cachectl gc)", n)
		}
	}
	return rep, nil
}

// checkChunk reads the chunk file of info, checks its size, CRC-32C and
// structure against the record, decodes every sample and checks the token
// count, and the draws of a sampled kind. Whatever is wrong with the file wraps ErrCorrupt; an error that
// does not is an I/O error (permission, EIO) that says nothing about the
// chunk's content.
func checkChunk(fs FS, dir string, m *Manifest, info ChunkInfo) error {
	c, err := loadChunkFile(fs, filepath.Join(dir, chunksDir, info.File), m, info)
	if err != nil {
		return err
	}
	var tokens int64
	var smp Sample
	for row := range c.index {
		if err := c.sample(row, &smp); err != nil {
			return err
		}
		// The draws' invariants (counts summing to N, ids distinct and
		// outside the head, the stored order) are the format's too.
		if err := validateDraws(m, &smp, fmt.Sprintf("sample %d", smp.Index)); err != nil {
			return fmt.Errorf("%w: chunk %s: %v", ErrCorrupt, info.File, err)
		}
		tokens += int64(len(smp.Tokens))
	}
	if tokens != info.Tokens {
		return fmt.Errorf("%w: chunk %s: %d tokens, the index says %d", ErrCorrupt, info.File, tokens, info.Tokens)
	}
	return nil
}
