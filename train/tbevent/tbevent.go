// Package tbevent writes TensorBoard event files with scalar summaries,
// without a TensorFlow dependency, and reads them back (for tests and
// tools).
//
// # File format
//
// A file named events.out.tfevents.<unix seconds>.<host>.<pid> (TensorBoard
// finds files whose name contains "tfevents") is a sequence of TFRecord
// records:
//
//	uint64 length          little-endian, the byte length of data
//	uint32 masked_crc32c(length's 8 bytes)
//	byte   data[length]    one serialized tensorflow.Event
//	uint32 masked_crc32c(data)
//
// with crc32c the Castagnoli CRC and masked(c) = ((c >> 15) | (c << 17)) +
// 0xa282ead8 (tensorflow/core/lib/hash/crc32c.h). The first Event carries
// file_version "brain.Event:2"; each later one a step and a Summary.
//
// The protobuf messages (tensorflow/core/util/event.proto and
// tensorflow/core/framework/summary.proto), written with protowire:
//
//	Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
//	          SessionLog session_log = 7; }
//	SessionLog { SessionStatus status = 1; }  // START = 1
//	Summary { repeated Value value = 1; }
//	Value   { string tag = 1; float simple_value = 2; }
package tbevent

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"os"
	"path/filepath"
	"sort"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// ErrCorrupt is wrapped by read errors about a malformed event file.
var ErrCorrupt = errors.New("tbevent: corrupt event file")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// MaskedCRC is TFRecord's masked CRC-32C of b.
func MaskedCRC(b []byte) uint32 {
	c := crc32.Checksum(b, castagnoli)
	return ((c >> 15) | (c << 17)) + 0xa282ead8
}

// Writer appends events to one event file.
type Writer struct {
	f    *os.File
	w    *bufio.Writer
	path string
}

// Create starts a new event file in dir (created if needed) and writes the
// file_version event.
func Create(dir string) (*Writer, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	host, _ := os.Hostname()
	if host == "" {
		host = "localhost"
	}
	name := fmt.Sprintf("events.out.tfevents.%d.%s.%d", time.Now().Unix(), host, os.Getpid())
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	for i := 1; os.IsExist(err) && i < 1000; i++ {
		// A second writer in the same second and process (a resumed run
		// in tests): a suffix keeps both files, which TensorBoard merges.
		path = filepath.Join(dir, fmt.Sprintf("%s.%d", name, i))
		f, err = os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	}
	if err != nil {
		return nil, err
	}
	w := &Writer{f: f, w: bufio.NewWriter(f), path: path}
	ev := protowire.AppendTag(nil, 1, protowire.Fixed64Type)
	ev = protowire.AppendFixed64(ev, math.Float64bits(float64(time.Now().UnixNano())/1e9))
	ev = protowire.AppendTag(ev, 3, protowire.BytesType)
	ev = protowire.AppendString(ev, "brain.Event:2")
	if err := w.record(ev); err != nil {
		f.Close()
		return nil, err
	}
	return w, w.Flush()
}

// Path returns the event file's path.
func (w *Writer) Path() string { return w.path }

func (w *Writer) record(data []byte) error {
	var hdr [12]byte
	binary.LittleEndian.PutUint64(hdr[:8], uint64(len(data)))
	binary.LittleEndian.PutUint32(hdr[8:], MaskedCRC(hdr[:8]))
	var tail [4]byte
	binary.LittleEndian.PutUint32(tail[:], MaskedCRC(data))
	if _, err := w.w.Write(hdr[:]); err != nil {
		return err
	}
	if _, err := w.w.Write(data); err != nil {
		return err
	}
	_, err := w.w.Write(tail[:])
	return err
}

// Scalars appends one event at step holding a scalar per tag, in tag order
// (deterministic files). Non-finite values are written as they are;
// TensorBoard shows them as NaN/Inf.
func (w *Writer) Scalars(step int64, wall time.Time, values map[string]float64) error {
	tags := make([]string, 0, len(values))
	for t := range values {
		tags = append(tags, t)
	}
	sort.Strings(tags)
	var sum []byte
	for _, t := range tags {
		var v []byte
		v = protowire.AppendTag(v, 1, protowire.BytesType)
		v = protowire.AppendString(v, t)
		v = protowire.AppendTag(v, 2, protowire.Fixed32Type)
		v = protowire.AppendFixed32(v, math.Float32bits(float32(values[t])))
		sum = protowire.AppendTag(sum, 1, protowire.BytesType)
		sum = protowire.AppendBytes(sum, v)
	}
	var ev []byte
	ev = protowire.AppendTag(ev, 1, protowire.Fixed64Type)
	ev = protowire.AppendFixed64(ev, math.Float64bits(float64(wall.UnixNano())/1e9))
	ev = protowire.AppendTag(ev, 2, protowire.VarintType)
	ev = protowire.AppendVarint(ev, uint64(step))
	ev = protowire.AppendTag(ev, 5, protowire.BytesType)
	ev = protowire.AppendBytes(ev, sum)
	return w.record(ev)
}

// SessionStart appends a SessionLog START event at step. A resumed run
// writes one with its first new step: TensorBoard (purge_orphaned_data, on
// by default) then drops the events of earlier files at steps >= step,
// which the crashed run logged past its last checkpoint and the resumed
// run logs again.
func (w *Writer) SessionStart(step int64, wall time.Time) error {
	var sl []byte
	sl = protowire.AppendTag(sl, 1, protowire.VarintType)
	sl = protowire.AppendVarint(sl, sessionStart)
	var ev []byte
	ev = protowire.AppendTag(ev, 1, protowire.Fixed64Type)
	ev = protowire.AppendFixed64(ev, math.Float64bits(float64(wall.UnixNano())/1e9))
	ev = protowire.AppendTag(ev, 2, protowire.VarintType)
	ev = protowire.AppendVarint(ev, uint64(step))
	ev = protowire.AppendTag(ev, 7, protowire.BytesType)
	ev = protowire.AppendBytes(ev, sl)
	return w.record(ev)
}

// sessionStart is SessionLog.SessionStatus START.
const sessionStart = 1

// Flush writes buffered events to the file (TensorBoard sees them then).
func (w *Writer) Flush() error { return w.w.Flush() }

// Close flushes, syncs and closes the file.
func (w *Writer) Close() error {
	err := w.w.Flush()
	if serr := w.f.Sync(); err == nil {
		err = serr
	}
	if cerr := w.f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Event is one decoded event.
type Event struct {
	WallTime    float64
	Step        int64
	FileVersion string
	Scalars     map[string]float32
	// SessionStart marks a SessionLog START event.
	SessionStart bool
}

// Read decodes every event of an event file, checking both CRCs of every
// record; a torn last record (a writer killed mid-write) is an error too.
func Read(path string) ([]Event, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var evs []Event
	for off := 0; off < len(b); {
		if len(b)-off < 12 {
			return evs, fmt.Errorf("%w: %s: %d trailing bytes at offset %d, a record header needs 12", ErrCorrupt, path, len(b)-off, off)
		}
		n := binary.LittleEndian.Uint64(b[off:])
		if MaskedCRC(b[off:off+8]) != binary.LittleEndian.Uint32(b[off+8:]) {
			return evs, fmt.Errorf("%w: %s: length CRC mismatch at offset %d", ErrCorrupt, path, off)
		}
		if n > uint64(len(b)-off-16) {
			return evs, fmt.Errorf("%w: %s: record at offset %d claims %d bytes, the file has %d left", ErrCorrupt, path, off, n, len(b)-off-16)
		}
		data := b[off+12 : off+12+int(n)]
		if MaskedCRC(data) != binary.LittleEndian.Uint32(b[off+12+int(n):]) {
			return evs, fmt.Errorf("%w: %s: data CRC mismatch in the record at offset %d", ErrCorrupt, path, off)
		}
		ev, err := decodeEvent(data)
		if err != nil {
			return evs, fmt.Errorf("%w: %s: record at offset %d: %v", ErrCorrupt, path, off, err)
		}
		evs = append(evs, ev)
		off += 16 + int(n)
	}
	return evs, nil
}

// fields walks a message's fields, calling fn with each number, type and
// raw value (the varint/fixed value in v, or the bytes in p).
func fields(b []byte, fn func(num protowire.Number, typ protowire.Type, v uint64, p []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var v uint64
		var p []byte
		switch typ {
		case protowire.VarintType:
			v, n = protowire.ConsumeVarint(b)
		case protowire.Fixed32Type:
			var x uint32
			x, n = protowire.ConsumeFixed32(b)
			v = uint64(x)
		case protowire.Fixed64Type:
			v, n = protowire.ConsumeFixed64(b)
		case protowire.BytesType:
			p, n = protowire.ConsumeBytes(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := fn(num, typ, v, p); err != nil {
			return err
		}
	}
	return nil
}

func decodeEvent(b []byte) (Event, error) {
	var ev Event
	err := fields(b, func(num protowire.Number, typ protowire.Type, v uint64, p []byte) error {
		switch {
		case num == 1 && typ == protowire.Fixed64Type:
			ev.WallTime = math.Float64frombits(v)
		case num == 2 && typ == protowire.VarintType:
			ev.Step = int64(v)
		case num == 3 && typ == protowire.BytesType:
			ev.FileVersion = string(p)
		case num == 7 && typ == protowire.BytesType:
			return fields(p, func(num protowire.Number, typ protowire.Type, v uint64, _ []byte) error {
				if num == 1 && typ == protowire.VarintType && v == sessionStart {
					ev.SessionStart = true
				}
				return nil
			})
		case num == 5 && typ == protowire.BytesType:
			if ev.Scalars == nil {
				ev.Scalars = map[string]float32{}
			}
			return fields(p, func(num protowire.Number, typ protowire.Type, _ uint64, p []byte) error {
				if num != 1 || typ != protowire.BytesType {
					return nil
				}
				var tag string
				var val float32
				var has bool
				err := fields(p, func(num protowire.Number, typ protowire.Type, v uint64, p []byte) error {
					switch {
					case num == 1 && typ == protowire.BytesType:
						tag = string(p)
					case num == 2 && typ == protowire.Fixed32Type:
						val, has = math.Float32frombits(uint32(v)), true
					}
					return nil
				})
				if err != nil {
					return err
				}
				if has {
					ev.Scalars[tag] = val
				}
				return nil
			})
		}
		return nil
	})
	return ev, err
}
