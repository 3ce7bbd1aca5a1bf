package dist

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"sort"
	"time"
)

// Wire format constants: changing them needs a new protoVersion.
const (
	// protoVersion opens every challenge and hello; a peer speaking
	// another version is refused.
	protoVersion = "distill-rdzv/1"
	// maxFrame bounds a frame after authentication; maxHelloFrame bounds
	// the frames an unauthenticated peer may send.
	maxFrame      = 16 << 20
	maxHelloFrame = 4 << 20
	nonceBytes    = 32
	// digestChars is the length of a config value's digest (hex).
	digestChars = 32
)

// The message types (message.Type).
const (
	msgChallenge = "challenge" // 0 -> r: proto, nonce
	msgHello     = "hello"     // r -> 0: proto, rank, world_size, nonce, mac, config_hash, config
	msgWelcome   = "welcome"   // 0 -> r: world_size, mac, config_hash, unique_id, heartbeat_ms
	msgRefuse    = "refuse"    // 0 -> r: error, key
	msgHeartbeat = "heartbeat" // both ways
	msgEnter     = "enter"     // r -> 0: seq, op, root, data
	msgRelease   = "release"   // 0 -> r: seq, data
	msgAbort     = "abort"     // both ways: rank, error
	msgBye       = "bye"       // both ways
)

// message is every frame's payload: a JSON object whose type says which
// of its fields are set (the constants above list them).
type message struct {
	Type       string            `json:"type"`
	Proto      string            `json:"proto,omitempty"`
	Rank       int               `json:"rank"`
	WorldSize  int               `json:"world_size,omitempty"`
	Nonce      []byte            `json:"nonce,omitempty"`
	MAC        []byte            `json:"mac,omitempty"`
	ConfigHash string            `json:"config_hash,omitempty"`
	Config     map[string]string `json:"config,omitempty"`
	UniqueID   []byte            `json:"unique_id,omitempty"`
	Heartbeat  int64             `json:"heartbeat_ms,omitempty"`
	Seq        uint64            `json:"seq,omitempty"`
	Op         string            `json:"op,omitempty"`
	Root       int               `json:"root,omitempty"`
	Data       []byte            `json:"data,omitempty"`
	Error      string            `json:"error,omitempty"`
	Key        string            `json:"key,omitempty"`
}

// writeMsg writes one frame: the payload's length (4 bytes, big endian),
// then the payload.
func writeMsg(c net.Conn, m *message, deadline time.Time) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > maxFrame {
		return fmt.Errorf("%s message of %d bytes exceeds the %d-byte frame limit", m.Type, len(b), maxFrame)
	}
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	c.SetWriteDeadline(deadline)
	_, err = c.Write(buf)
	return err
}

// readMsg reads one frame of at most limit bytes.
func readMsg(r io.Reader, limit int) (*message, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > uint32(limit) {
		return nil, fmt.Errorf("frame of %d bytes exceeds the %d-byte limit", n, limit)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	m := new(message)
	if err := json.Unmarshal(b, m); err != nil {
		return nil, fmt.Errorf("malformed frame: %v", err)
	}
	return m, nil
}

// mac proves knowledge of the token: HMAC-SHA256(token, side || nonce),
// nil without a token. The token itself never travels.
func mac(token, side string, nonce []byte) []byte {
	if token == "" {
		return nil
	}
	h := hmac.New(sha256.New, []byte(token))
	h.Write([]byte(protoVersion + " " + side + "\x00"))
	h.Write(nonce)
	return h.Sum(nil)
}

// digestConfig hashes each value of a flattened config (its digest on the
// wire) and the whole config (sorted keys with their digests).
func digestConfig(cfg map[string]string) (digests map[string]string, hash string) {
	digests = make(map[string]string, len(cfg))
	keys := make([]string, 0, len(cfg))
	for k, v := range cfg {
		s := sha256.Sum256([]byte(v))
		digests[k] = hex.EncodeToString(s[:])[:digestChars]
		keys = append(keys, k)
	}
	sort.Strings(keys)
	h := sha256.New()
	for _, k := range keys {
		fmt.Fprintf(h, "%s\x00%s\x00", k, digests[k])
	}
	return digests, hex.EncodeToString(h.Sum(nil))
}

// firstDiff is the first key, in sorted order, whose digest differs
// between a and b or that only one of them has; "" when none.
func firstDiff(a, b map[string]string) string {
	keys := make([]string, 0, len(a)+len(b))
	for k := range a {
		keys = append(keys, k)
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		va, oka := a[k]
		vb, okb := b[k]
		if oka != okb || va != vb {
			return k
		}
	}
	return ""
}

// describeValue is a config key's value for a message: quoted, or "(not
// set)" when the config has no such key.
func describeValue(cfg map[string]string, key string) string {
	v, ok := cfg[key]
	if !ok {
		return "(not set)"
	}
	if len(v) > 200 {
		v = v[:200] + "..."
	}
	return fmt.Sprintf("%q", v)
}
