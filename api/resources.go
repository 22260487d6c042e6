// The fenced reference store's documents.

package api

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/refstore"
)

func (h *Handler) putResource(w http.ResponseWriter, r *http.Request) {
	if err := h.doPut(w, r); err != nil {
		if errors.Is(err, fencing.ErrStale) {
			h.m.staleWrites.Inc()
		}
		h.writeError(w, r, err)
	}
}

func (h *Handler) doPut(w http.ResponseWriter, r *http.Request) error {
	name, key, err := h.key(r)
	var req PutResourceRequest
	bad, err := problems(err, h.decode(w, r, &req, false))
	if err != nil {
		return err
	}
	cond, cerr := putCondition(r)
	_ = bad.merge(cerr) // an invalid-request, or nil
	if !bad.unreadable {
		switch {
		case bad.has("fencing_token"): // null, not an integer, repeated: said
			bad.beyondInt64("fencing_token", "must be a positive integer at most 9007199254740991 (2^53-1)")
		case req.FencingToken == nil:
			bad.add("fencing_token is required: a positive integer (the fencing_token of your grant)",
				InvalidParam{Name: "fencing_token", Reason: "required: a positive integer"})
		case *req.FencingToken < 1:
			bad.add("fencing_token must be a positive integer (the fencing_token of your grant)",
				InvalidParam{Name: "fencing_token", Reason: "must be a positive integer"})
		case *req.FencingToken > int64(fencing.MaxToken):
			bad.add("fencing_token must be at most 9007199254740991 (2^53-1, the largest token issued)",
				InvalidParam{Name: "fencing_token", Reason: "must be at most 9007199254740991 (2^53-1)"})
		}
		if len(req.Data) == 0 {
			bad.add("data is required (any JSON value)", InvalidParam{Name: "data", Reason: "required (any JSON value)"})
		} else if err := refstore.CheckJSON(req.Data); err != nil {
			// What Postgres would refuse, refused with the rest (the
			// store checks it again).
			var de *refstore.DataError
			if errors.As(err, &de) {
				bad.add("data "+de.Reason, InvalidParam{Name: "data", Reason: de.Reason})
			}
		}
	}
	if err := bad.err(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.StoreTimeout)
	defer cancel()
	res, err := h.store.PutResourceIf(ctx, key, fencing.Token(*req.FencingToken), req.Data, cond)
	if err != nil {
		return err
	}
	setHeader(w, "ETag", etag(res.Version))
	writeJSON(w, http.StatusOK, resourceJSON(name, res))
	return nil
}

func resourceJSON(name string, res *refstore.Resource) *Resource {
	return &Resource{Name: name, Data: res.Data, FencingToken: int64(res.FencingToken), Version: res.Version,
		UpdatedAt: res.UpdatedAt.UTC().Format(time.RFC3339Nano)}
}

func (h *Handler) getResource(w http.ResponseWriter, r *http.Request) {
	name, key, err := h.key(r)
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.StoreTimeout)
	defer cancel()
	// Malformed conditions are refused before the store is asked.
	im, err := parseEntityTags(r.Header, "If-Match")
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	inm, err := parseEntityTags(r.Header, "If-None-Match")
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	res, err := h.store.GetResource(ctx, key)
	if err != nil {
		// With no document the answer is 404 whatever the conditions: a
		// server ignores them when the request without them would fail
		// (RFC 9110 §13.2.1), as a GET of nothing does.
		h.writeError(w, r, err)
		return
	}
	setHeader(w, "ETag", etag(res.Version))
	if im.present && !im.match(res.Version) {
		h.writeError(w, r, &refstore.PreconditionError{Key: key, Version: res.Version})
		return
	}
	if inm.present && inm.noneMatch(res.Version) {
		setHeader(w, "Cache-Control", "no-store")
		w.WriteHeader(http.StatusNotModified)
		return
	}
	writeJSON(w, http.StatusOK, resourceJSON(name, res))
}
